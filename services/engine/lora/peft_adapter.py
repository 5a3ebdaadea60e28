"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) as
the engine applies it: per decoder layer and projection, A [r, in] and B [r, out] with the
scaling folded into B.

Only the Llama-family projections are adapted (q/k/v/o and gate/up/down); an adapter that
touches anything else (embeddings, the LM head, ``modules_to_save``, per-module rank patterns)
is refused at start-up with the reason, rather than served half-applied."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from pdserve.shared.errors import ModelLoadError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float


@dataclass
class PeftAdapter:
    name: str
    config: AdapterConfig
    # (layer, projection) -> (A [r, in], B [r, out] * scaling), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_config(name: str, path: Path) -> AdapterConfig:
    """The rank and scaling an adapter directory declares (cheap: start-up checks read only this)."""
    try:
        raw = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        message = f"LoRA adapter {name!r}: cannot read {path}/adapter_config.json: {exc}"
        raise ModelLoadError(message) from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(
            f"LoRA adapter {name!r}: peft_type {raw.get('peft_type')!r} is not LORA"
        )
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if raw.get(key):
            raise ModelLoadError(f"LoRA adapter {name!r}: {key} is not supported")
    rank = int(raw["r"])
    alpha = float(raw.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank=rank, scaling=scaling)


def load_adapter(name: str, path: Path, num_layers: int) -> PeftAdapter:
    """The adapter's weights, checked against the model's layer count."""
    config = read_config(name, path)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ModelLoadError(f"LoRA adapter {name!r}: {file} is missing")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PROJECTIONS or int(m.group(1)) >= num_layers:
            raise ModelLoadError(f"LoRA adapter {name!r}: cannot apply tensor {key!r}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    adapter = PeftAdapter(name=name, config=config)
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ModelLoadError(f"LoRA adapter {name!r}: {where} lacks lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()  # PEFT: A [r, in], B [out, r]
        adapter.weights[where] = (a, b.T.contiguous() * config.scaling)
    return adapter
