"""GGUF tensors -> Hugging Face Llama/Qwen2 tensors, written as one safetensors file.

Three things differ from an HF checkpoint:

- names: llama.cpp's ``blk.N.attn_q.weight`` is HF's ``model.layers.N.self_attn.q_proj.weight``;
- values: quantized blocks are expanded to float with ``gguf.quants.dequantize``, except a
  linear layer's Q8_0 matrix, which is kept as it is stored, split in two tensors:
  ``<layer>.q8_0_values`` int8 [N, K] and ``<layer>.q8_0_scales`` float16 [N, K // 32] (one scale
  per block of 32 input channels, W = values * scale exactly), so ``--quantization int8`` can use
  the file's own INT8 weights (services/engine/loader.py dequantizes them for a float model,
  bit for bit what ``dequantize`` gives). The embedding is a lookup table, always expanded;
- layout: llama.cpp's converter permutes the rows of Llama's Q and K projections (it rotates
  interleaved pairs, HF rotates halves). We undo that permutation exactly as transformers does
  when it loads a GGUF, so the weights match HF's (Qwen2 files are not permuted).

Tensors are dequantized and written one at a time, so converting a large file needs memory for
one tensor, not the whole model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.shared.errors import ModelLoadError
from pdserve.shared.models.gguf_file import GGUFFile, GGUFTensor

# The types the converter expands. Others (IQ*, Q2_K, Q3_K, TQ*...) fail at start-up by name.
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors llama.cpp adds that have no HF counterpart; their content is taken into the config.
_NOT_WEIGHTS = {"rope_freqs.weight"}
# The matrices of linear layers (HF name suffixes): kept in Q8_0 when the file stores them so.
_LINEARS = ("_proj.weight", "lm_head.weight")
Q8_0_BLOCK = 32  # input channels per Q8_0 scale
Q8_0_VALUES, Q8_0_SCALES = "q8_0_values", "q8_0_scales"


@dataclass(frozen=True)
class Planned:
    """One output tensor: where it comes from and how it is stored."""

    hf_name: str
    source: GGUFTensor
    dtype: str  # safetensors dtype: "F16" or "F32"; "Q8_0": kept as values and scales
    heads: int | None  # rows are un-permuted in groups of this many heads (Q, K); None = as is

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of each tensor written for this one."""
        if self.dtype != "Q8_0":
            return [(self.hf_name, self.dtype, self.source.shape)]
        rows, cols = self.source.shape
        layer = q8_0_layer(self.hf_name)
        return [
            (f"{layer}.{Q8_0_VALUES}", "I8", (rows, cols)),
            (f"{layer}.{Q8_0_SCALES}", "F16", (rows, cols // Q8_0_BLOCK)),
        ]


def q8_0_layer(weight_name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    return weight_name.removesuffix(".weight")


def storage_dtype(hf: str, type_name: str) -> str:
    if type_name == "Q8_0" and hf.endswith(_LINEARS):
        return "Q8_0"
    # F16 keeps its own type (exact, half the size); everything else expands to F32, the only
    # float type that holds every dequantized value exactly.
    return "F16" if type_name == "F16" else "F32"


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def plan(f: GGUFFile, cfg: dict[str, Any]) -> list[Planned]:
    """Every tensor the model needs, checked for presence, type and shape before any is read."""
    arch = cfg["model_type"]
    expected = expected_shapes(cfg)
    out: list[Planned] = []
    by_hf: dict[str, GGUFTensor] = {}
    for t in f.tensors.values():
        name = hf_name(t.name)
        if name is None:
            if t.name in _NOT_WEIGHTS:
                continue
            raise ModelLoadError(f"{f.path}: unexpected tensor {t.name!r} for a {arch} model")
        by_hf[name] = t
    for name, shape in expected.items():
        t = by_hf.get(name)
        if t is None:
            raise ModelLoadError(f"{f.path}: missing tensor {gguf_name_of(name)!r} ({name})")
        if t.type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} has type {t.type_name}, which pdserve cannot "
                f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        if t.shape != shape:
            raise ModelLoadError(
                f"{f.path}: tensor {t.name!r} has shape {list(t.shape)}, the metadata implies "
                f"{list(shape)}"
            )
        heads = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            heads = cfg["num_attention_heads"]
        elif arch == "llama" and ".self_attn.k_proj." in name:
            heads = cfg["num_key_value_heads"]
        out.append(
            Planned(hf_name=name, source=t, dtype=storage_dtype(name, t.type_name), heads=heads)
        )
    extra = sorted(set(by_hf) - set(expected))
    if extra:
        raise ModelLoadError(f"{f.path}: unexpected tensor {gguf_name_of(extra[0])!r}")
    return out


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_rows = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_rows = cfg["num_key_value_heads"] * cfg["head_dim"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q_rows, h),
            f"{p}.self_attn.k_proj.weight": (kv_rows, h),
            f"{p}.self_attn.v_proj.weight": (kv_rows, h),
            f"{p}.self_attn.o_proj.weight": (h, q_rows),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }
        if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
            out |= {
                f"{p}.self_attn.q_proj.bias": (q_rows,),
                f"{p}.self_attn.k_proj.bias": (kv_rows,),
                f"{p}.self_attn.v_proj.bias": (kv_rows,),
            }
    return out


def gguf_name_of(hf: str) -> str:
    for g, name in _GLOBAL_NAMES.items():
        if name == hf:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m:
        for g, name in _LAYER_NAMES.items():
            if name == m.group(2):
                return f"blk.{m.group(1)}.{g}"
    return hf


def dequantized(t: GGUFTensor):
    """The tensor as a float32 numpy array of its logical shape."""
    from gguf.quants import dequantize

    try:
        return dequantize(t.raw, t.type_id).reshape(t.shape)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot dequantize tensor {t.name!r} ({t.type_name}): {exc}"
        ) from None


def unpermute_rows(w, heads: int):
    """Undo llama.cpp's rotary row permutation of a Q or K projection (weight or bias).

    llama.cpp stores each head's rows as (pairs, 2) interleaved where HF keeps (2, pairs) halves;
    viewing the rows as [heads, pairs, 2] and swapping the last two axes restores HF's order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_0_blocks(t: GGUFTensor):
    """A Q8_0 matrix's (values int8 [N, K], scales float16 [N, K // 32]) as stored, unexpanded.

    A block is 34 bytes: its float16 scale d, then 32 int8 values; W[n, k] = q[n, k] * d."""
    import numpy as np

    rows, cols = t.shape
    blocks = np.asarray(t.raw, dtype=np.uint8).reshape(rows, cols // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(rows, -1)
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return values, scales


def converted(p: Planned) -> list:
    """The output tensors' values (one per ``p.outputs()``), in their storage dtypes."""
    import numpy as np

    if p.dtype == "Q8_0":
        parts = list(q8_0_blocks(p.source))
    else:
        w = dequantized(p.source)
        parts = [w.astype(np.float16 if p.dtype == "F16" else np.float32, copy=False)]
    if p.heads is not None:  # a row's values and its block scales move together
        parts = [unpermute_rows(part, p.heads) for part in parts]
    return [np.ascontiguousarray(part) for part in parts]


def write_safetensors(path: Path, planned: list[Planned], metadata: dict[str, str]) -> None:
    """Stream ``planned`` into one safetensors file, a tensor at a time.

    The format is an 8-byte little-endian header length, a JSON header of dtype, shape and byte
    range per tensor, then the raw bytes; the header is known before any value is computed."""
    header: dict[str, Any] = {"__metadata__": metadata}
    outputs = [out for p in planned for out in p.outputs()]
    sizes = [_numel(shape) * _ITEM_SIZE[dtype] for _, dtype, shape in outputs]
    offset = 0
    for (name, dtype, shape), nbytes in zip(outputs, sizes, strict=True):
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        parts = (part for p in planned for part in converted(p))
        for (name, _, _), nbytes, part in zip(outputs, sizes, parts, strict=True):
            data = part.tobytes()
            if len(data) != nbytes:
                raise ModelLoadError(f"tensor {name!r}: converted to the wrong size")
            out.write(data)


_ITEM_SIZE = {"F32": 4, "F16": 2, "I8": 1}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
