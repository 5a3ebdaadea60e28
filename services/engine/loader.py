"""Load Hugging Face safetensors checkpoints into the engine's fused model layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.model import LlamaForCausalLM
from services.engine.model_config import ModelConfig
from services.engine.quant.int8_linear import quantize_linears
from services.engine.quant.smooth import calibration_ids
from shared.errors import ModelLoadError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]


class CheckpointFiles:
    """Maps tensor names to the safetensors file that holds them (single file or sharded)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no 'weight_map' object")
            self.where = {name: model_dir / fname for name, fname in weight_map.items()}
            self.describe = index
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), single)
            self.describe = single
        else:
            raise ModelLoadError(
                f"{model_dir}: no model.safetensors or model.safetensors.index.json"
            )
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        path = self.where.get(name)
        if path is None:
            raise ModelLoadError(f"{self.describe}: missing tensor {name!r}")
        if not path.is_file():
            raise ModelLoadError(f"{path}: shard file not found (needed for tensor {name!r})")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt")
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {exc}") from None

    def file_of(self, name: str) -> Path:
        return self.where.get(name, self.describe)


def _hf_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the checkpoint tensors concatenated (dim 0) to make it."""
    out: dict[str, list[str]] = {
        "embed_tokens.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn = f"{hf}.self_attn"
        out[f"{ours}.self_attn.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        if cfg.qkv_bias:
            out[f"{ours}.self_attn.qkv_proj.bias"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
        out[f"{ours}.self_attn.o_proj.weight"] = [f"{attn}.o_proj.weight"]
        out[f"{ours}.mlp.gate_up_proj.weight"] = [
            f"{hf}.mlp.gate_proj.weight",
            f"{hf}.mlp.up_proj.weight",
        ]
        out[f"{ours}.mlp.down_proj.weight"] = [f"{hf}.mlp.down_proj.weight"]
        out[f"{ours}.input_layernorm.weight"] = [f"{hf}.input_layernorm.weight"]
        out[f"{ours}.post_attention_layernorm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
    return out


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "none",
) -> LlamaForCausalLM:
    """The checkpoint's model on ``device`` in ``dtype``; ``quantization`` int8 then swaps every
    linear layer for its INT8 form (services/engine/quant/)."""
    files = CheckpointFiles(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, torch.Tensor] = {}
    for ours, sources in _hf_sources(cfg).items():
        expected = params[ours].shape
        pieces = [files.get(name) for name in sources]
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        if tensor.shape != expected:
            shapes = ", ".join(
                f"{n} {tuple(p.shape)}" for n, p in zip(sources, pieces, strict=True)
            )
            raise ModelLoadError(
                f"{files.file_of(sources[0])}: shape mismatch for {shapes}; "
                f"config.json implies {tuple(expected)} for {ours}"
            )
        loaded[ours] = tensor.to(device=device, dtype=dtype)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in loaded.items():
            params[name].copy_(tensor)
    del loaded, params  # the float weights a quantized layer replaces are freed with it
    if quantization == "int8":  # smoothed against activations of a text in its own tokens
        quantize_linears(model, device, dtype, calibration_ids=calibration_ids(model_dir))
    return model.eval().requires_grad_(False)
