"""The subset of a Hugging Face ``config.json`` that the Llama-family model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.shared.errors import ModelLoadError

# model_type -> whether q/k/v projections carry a bias regardless of config flags
SUPPORTED_MODEL_TYPES = {"llama": False, "qwen2": True, "mistral": False}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path}: not found; --model must be a Hugging Face model directory"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: invalid JSON: {exc}") from None
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = raw.get("architectures")
            raise ModelLoadError(
                f"{path}: unsupported architecture model_type={model_type!r} architectures={arch}; "
                f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
                None,
                "default",
            ):
                scaling = None
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=SUPPORTED_MODEL_TYPES[model_type]
                or bool(raw.get("attention_bias", False)),
                eos_token_ids=_eos_ids(model_dir, raw),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{path}: missing required field {exc.args[0]!r}") from None


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what generate() honours, so it wins over config.json
    gen_path = model_dir / "generation_config.json"
    value = raw.get("eos_token_id")
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        if gen.get("eos_token_id") is not None:
            value = gen["eos_token_id"]
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
