"""Load Hugging Face safetensors checkpoints into the engine's fused model layout.

A converted GGUF may keep a linear layer's Q8_0 matrix as int8 values and float16 block scales
(shared/models/gguf_weights.py). A float model gets it dequantized, bit for bit the float32 the
converter used to write; the INT8 weight-only path (``--quantization int8`` off the CPU) builds its
layers from the values and scales themselves, fused rows concatenated, and never allocates the
float weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.services.engine.model import LlamaForCausalLM
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.parallel.shard import SINGLE, Shard, shard_piece
from pdserve.services.engine.quant.int8_linear import (
    WeightOnlyInt8Linear,
    quantization_targets,
    quantize_linears,
    uses_weight_only,
)
from pdserve.services.engine.quant.int8_weights import Int8Weight, quantize_groupwise
from pdserve.services.engine.quant.smooth import calibration_ids
from pdserve.shared.errors import ModelLoadError
from pdserve.shared.models.gguf_weights import Q8_0_BLOCK, Q8_0_SCALES, Q8_0_VALUES, q8_0_layer

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
    if dev.type == "cuda" and dev.index is None:
        # an explicit index: torch.cuda.set_device and the KV agents' memory need one
        dev = torch.device("cuda", torch.cuda.current_device())
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
        # weights stored as Q8_0 values + scales, by the name of the float weight they stand for
        suffix = f".{Q8_0_VALUES}"
        self.q8_0 = {
            f"{name.removesuffix(suffix)}.weight" for name in self.where if name.endswith(suffix)
        }

    def has(self, name: str) -> bool:
        return name in self.where or name in self.q8_0

    def names(self) -> list[str]:
        """Every tensor by the name ``get`` takes (a Q8_0 pair by its float weight's)."""
        parts = (f".{Q8_0_VALUES}", f".{Q8_0_SCALES}")
        return sorted({n for n in self.where if not n.endswith(parts)} | self.q8_0)

    def get(self, name: str) -> torch.Tensor:
        """The tensor; a Q8_0 weight dequantized to float32 (exact: int8 times float16)."""
        if name in self.q8_0:
            return self.q8_0_weight(name).dequantize(torch.float32)
        return self._read(name)

    def q8_0_weight(self, name: str) -> Int8Weight:
        """A Q8_0 weight as stored: int8 [N, K] and float16 scales [N, K // 32]."""
        layer = q8_0_layer(name)
        return Int8Weight(
            self._read(f"{layer}.{Q8_0_VALUES}"), self._read(f"{layer}.{Q8_0_SCALES}")
        )

    def _read(self, name: str) -> torch.Tensor:
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
        if name in self.q8_0:
            name = f"{q8_0_layer(name)}.{Q8_0_VALUES}"
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
    weight_only: bool | None = None,
    shard: Shard = SINGLE,
) -> LlamaForCausalLM:
    """The checkpoint's model on ``device`` in ``dtype``; ``quantization`` int8 then swaps every
    linear layer for its INT8 form (services/engine/quant/), weight-only off the CPU or when
    ``weight_only`` says so (``int8_linear.uses_weight_only``). With a ``shard`` of TP > 1, only
    this rank's slice of each sharded tensor is kept (``parallel/shard.py``); INT8 rounding then
    runs per rank on its slice, its calibration pass a sharded forward that every rank runs."""
    files = CheckpointFiles(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, shard)
    direct: dict[str, nn.Module] = {}
    if quantization == "int8" and uses_weight_only(device, weight_only):
        direct = q8_0_int8_linears(files, model, cfg, device, dtype, shard)
        for name in direct:  # a placeholder, so materialising the model allocates no float copy
            model.set_submodule(name, nn.Identity())
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, torch.Tensor] = {}
    for ours, sources in _hf_sources(cfg).items():
        if ours.rpartition(".")[0] in direct:
            continue
        expected = params[ours].shape
        pieces = [shard_piece(ours, i, files.get(n), cfg, shard) for i, n in enumerate(sources)]
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        check_shape(files, ours, sources, pieces, tensor.shape, expected)
        loaded[ours] = tensor.to(device=device, dtype=dtype)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and "lm_head" not in direct:
        embedding = model.embed_tokens.weight
        if model.vocab_parallel:  # this rank's rows of the shared matrix (a view when unpadded)
            embedding = nn.Parameter(shard_piece("lm_head.weight", 0, embedding, cfg, shard))
        model.lm_head.weight = embedding
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in loaded.items():
            params[name].copy_(tensor)
    del loaded, params  # the float weights a quantized layer replaces are freed with it
    for name, module in direct.items():
        model.set_submodule(name, module)
    if quantization == "int8":  # the rest; smoothed against a text in its own tokens (CPU W8A8)
        ids = calibration_ids(model_dir)
        quantize_linears(model, device, dtype, calibration_ids=ids, weight_only=weight_only)
    return model.eval().requires_grad_(False)


def q8_0_int8_linears(
    files: CheckpointFiles,
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard = SINGLE,
) -> dict[str, nn.Module]:
    """Weight-only INT8 layers built from the checkpoint's Q8_0 values and group scales as they
    are (a fused layer's rows concatenated), by module name; a layer with any piece in another
    type is left to ``quantize_linears``.

    A tied head shares the embedding, which is stored float. When that embedding lies exactly on a
    Q8_0 grid (it was Q8_0 in the GGUF), the head is rounded group-wise with G = 32, which gives
    the file's blocks back exactly (``quantize_groupwise``); otherwise it is left to the
    per-channel rounding of ``quantize_linears``, as for any float checkpoint."""
    sources = _hf_sources(cfg)
    out: dict[str, nn.Module] = {}
    targets = dict(quantization_targets(model))
    for name, linear in targets.items():
        weights = sources.get(f"{name}.weight", [])
        if not weights or not all(w in files.q8_0 for w in weights):
            continue
        pieces = [
            _shard_int8(f"{name}.weight", i, files.q8_0_weight(w), cfg, shard)
            for i, w in enumerate(weights)
        ]
        qweight = torch.cat([p.qweight for p in pieces])
        check_shape(
            files, name, weights, [p.qweight for p in pieces], qweight.shape, linear.weight.shape
        )
        weight = Int8Weight(qweight, torch.cat([p.scale for p in pieces]))
        bias_names = sources.get(f"{name}.bias")
        bias = None
        if bias_names:
            parts = [
                shard_piece(f"{name}.bias", i, files.get(b), cfg, shard)
                for i, b in enumerate(bias_names)
            ]
            bias = torch.cat(parts).to(device=device, dtype=dtype)
        out[name] = WeightOnlyInt8Linear(weight.to(device), bias)
    if out and cfg.tie_word_embeddings and "lm_head" in targets:
        embedding = files.get("model.embed_tokens.weight").float()
        embedding = shard_piece("lm_head.weight", 0, embedding, cfg, shard)
        head = quantize_groupwise(embedding, Q8_0_BLOCK)
        if torch.equal(head.dequantize(torch.float32), embedding):
            out["lm_head"] = WeightOnlyInt8Linear(head.to(device), None)
    return out


def _shard_int8(name: str, index: int, w: Int8Weight, cfg: ModelConfig, shard: Shard) -> Int8Weight:
    """This rank's slice of a Q8_0 weight: its values as a float weight's, its group scales
    cut at the same input columns (every rank's slice starts on a group boundary)."""
    if shard.size == 1:
        return w
    qweight = shard_piece(name, index, w.qweight, cfg, shard)
    if qweight.shape[0] != w.qweight.shape[0]:  # column-parallel: output rows
        return Int8Weight(qweight, shard_piece(name, index, w.scale, cfg, shard))
    group = w.qweight.shape[1] // w.scale.shape[1]
    cols = shard_piece(name, index, torch.arange(w.qweight.shape[1]).unsqueeze(0), cfg, shard)[0]
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    if lo % group or hi % group:
        raise ModelLoadError(f"{name}: rank {shard.rank}'s columns cut a Q8_0 group of {group}")
    return Int8Weight(qweight, w.scale[:, lo // group : hi // group])


def check_shape(
    files: CheckpointFiles,
    ours: str,
    sources: list[str],
    pieces: list[torch.Tensor],
    got: torch.Size,
    expected: torch.Size,
) -> None:
    if got != expected:
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(sources, pieces, strict=True))
        raise ModelLoadError(
            f"{files.file_of(sources[0])}: shape mismatch for {shapes}; "
            f"config.json implies {tuple(expected)} for {ours}"
        )
