"""The one dispatch point per kernel. The engine calls only these (`from pdserve.kernels import ops`).

`PDSERVE_KERNELS=auto|triton|torch` picks the implementation, read once when this module is
imported (a bad value fails there); tests and benchmarks switch with `set_backend`. `auto` runs
Triton on CUDA tensors (float64 excepted) and the plain-torch reference otherwise, `triton`
forces Triton (on CPU tensors that needs `TRITON_INTERPRET=1`), `torch` forces the reference. The Triton modules are imported on first use, so CPU-only processes never
compile anything.

Triton launches on the *current* CUDA device: a process serving on cuda:N must call
torch.cuda.set_device(N) once (or see only that GPU through CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch
from torch import Tensor

from pdserve.kernels import reference, reference_lora, reference_quant

BACKENDS = ("auto", "triton", "torch")

# op name -> module that holds its Triton implementation (function of the same name)
_TRITON_MODULES = {
    "rms_norm": "pdserve.kernels.triton_norm",
    "rotary_embedding": "pdserve.kernels.triton_rotary",
    "store_kvcache": "pdserve.kernels.triton_cache",
    "decode_attention": "pdserve.kernels.triton_decode",
    "prefill_attention": "pdserve.kernels.triton_prefill",
    "int8_linear": "pdserve.kernels.triton_int8",
    "lora_delta": "pdserve.kernels.triton_lora",
}


def _parse(mode: str) -> str:
    mode = mode.strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"PDSERVE_KERNELS={mode!r}; expected one of {', '.join(BACKENDS)}")
    return mode


_mode = _parse(os.environ.get("PDSERVE_KERNELS", "auto"))


def set_backend(mode: str) -> str:
    """Switch every op to ``mode`` (auto, triton or torch); returns the previous mode."""
    global _mode
    previous, _mode = _mode, _parse(mode)
    return previous


def backend_for(tensor: Tensor) -> str:
    """ "triton" or "torch": what a call with this tensor runs under the selected backend."""
    mode = _mode
    if mode == "auto":
        # The Triton kernels accumulate in fp32; float64 (a debugging dtype) stays on the twin.
        return "triton" if tensor.is_cuda and tensor.dtype != torch.float64 else "torch"
    return mode


@functools.cache
def _triton_impl(name: str) -> Callable:
    return getattr(importlib.import_module(_TRITON_MODULES[name]), name)


def _impl(name: str, tensor: Tensor) -> Callable:
    if backend_for(tensor) == "triton":
        return _triton_impl(name)
    twins = {"int8_linear": reference_quant, "lora_delta": reference_lora}
    return getattr(twins.get(name, reference), name)


def _kv_scales(k_scale: Tensor | None, v_scale: Tensor | None) -> dict[str, Tensor]:
    # passed on only for a quantized cache, so float-cache calls keep their exact old signature
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """x [T,H]. With residual: s = x + residual, returns (rmsnorm(s) * weight, s); else
    (rmsnorm(x) * weight, None). Norm in fp32, cast back (HF LlamaRMSNorm)."""
    return _impl("rms_norm", x)(x, weight, eps, residual)


def build_rope_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None,
    device: torch.device | str | None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """[max_position, head_dim] table: first half cos, second half sin of the D/2 frequencies.
    rope_scaling: None, "default", "linear" or "llama3" (HF semantics). Built once; no kernel."""
    return reference.build_rope_cache(head_dim, max_position, base, rope_scaling, device, dtype)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> None:
    """In-place neox-style rotary on q [T,Hq,D] and k [T,Hk,D] at positions [T] (int64)."""
    _impl("rotary_embedding", q)(positions, q, k, cos_sin_cache)


def rotated(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """``rotary_embedding``'s q and k as new tensors: for traced (compiled) code."""
    return reference.rotated(positions, q, k, cos_sin_cache)


def store_kvcache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Scatter key/value [T,Hk,D] into k/v_cache [blocks, block_size, Hk, D] (strided views ok)
    at slot_mapping [T] (int64, block_id * block_size + offset; -1 = skip).

    A quantized cache (int8 or float8_e4m3fn values) comes with k/v_scale [blocks, block_size,
    Hk, 1] float32: each token-head vector is stored as values and its one scale
    (kernels/reference_quant.py). Every attention op takes the same scales to read it back."""
    scales = _kv_scales(k_scale, v_scale)
    _impl("store_kvcache", key)(key, value, k_cache, v_cache, slot_mapping, **scales)


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    k_cache: Tensor | None = None,
    v_cache: Tensor | None = None,
    block_tables: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Varlen causal GQA attention; q [T,Hq,D], k/v [T,Hk,D] packed, cu_seqlens [B+1] int32.

    Without block_tables the keys are the packed k/v (k_len == q_len). With block_tables
    [B, maxblocks] int32 the keys/values come from the paged cache (the new tokens already
    stored there) and query j of seq i sits at position k_len - q_len + j. Returns [T,Hq,D].
    k/v_scale: a quantized cache's scales (see store_kvcache).
    """
    return _impl("prefill_attention", q)(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        k_cache,
        v_cache,
        block_tables,
        **_kv_scales(k_scale, v_scale),
    )


def decode_plan(
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor | None = None,
    max_seqlen_q: int = 1,
) -> object | None:
    """Per-step work that every layer's decode_attention shares (the CPU twin's length groups,
    gather indices and masks): make it once per forward pass, with the same query layout as the
    calls, and hand it to each layer's call. None where the backend needs none (the Triton
    kernel reads pages in place)."""
    if backend_for(block_tables) == "triton":
        return None
    return reference.DecodePlan(block_tables, context_lens, cu_seqlens_q, max_seqlen_q)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    plan: object | None = None,
    cu_seqlens_q: Tensor | None = None,
    max_seqlen_q: int = 1,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Paged GQA attention of a decode step: each sequence's newest token(s) over its cache.

    Plain decode: one query per sequence, q [B,Hq,D], over context_lens[i] cached tokens.
    Speculative verification: q [T,Hq,D] packed, sequence i owning rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] ([B+1] int32, q_len_i >= 1, different per sequence), its
    last q_len_i tokens whose K/V are already stored; query j sits at position
    context_lens[i] - q_len_i + j and sees keys 0..that position (causal among the new tokens).
    max_seqlen_q (a host int, so no device sync) bounds every q_len_i; with max_seqlen_q 1 it
    is the plain decode path exactly (cu_seqlens_q is then ignored). Returns q's shape.
    ``plan``: decode_plan(block_tables, context_lens, cu_seqlens_q, max_seqlen_q) of this step,
    or None. k/v_scale: a quantized cache's scales (see store_kvcache).
    """
    return _impl("decode_attention", q)(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        plan,
        cu_seqlens_q,
        max_seqlen_q,
        **_kv_scales(k_scale, v_scale),
    )


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Paged GQA decode attention, one query per sequence (q [B, Hq, D]), reading the pages in
    place: the form a compiled decode step traces (``kernels/paged_decode.py``; plain torch that
    Inductor fuses, no host syncs, the table's block count a dynamic size). Same contract as
    ``decode_attention`` with max_seqlen_q 1; a row with context 0 (padding) returns zeros."""
    from pdserve.kernels.paged_decode import paged_decode_attention as impl

    return impl(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def store_kv_graph(key: Tensor, value: Tensor, pages: Tensor, rows: Tensor) -> None:
    """``store_kvcache`` into one layer's float pages [blocks, 2, block_size, Hk, D] (K then
    V), as one opaque in-place call of a compiled step (``kernels/graph_ops.py``: traced as
    indexing, the write would copy the cache); ``rows`` is ``graph_ops.kv_rows`` of the slots."""
    from pdserve.kernels import graph_ops

    graph_ops.store(key, value, pages, rows)


def int8_linear(x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """Weight-only INT8 linear: x [M, K] @ (qweight [N, K] int8 * scale).T (+ bias [N]) -> [M, N]
    in x's dtype, accumulated in fp32. scale is per output channel, [N] fp32, or per group of G
    consecutive input channels, [N, K // G] (fp32 or fp16, GGUF Q8_0 is G = 32); G must be a power
    of two >= 16, and each group's scale is applied to its partial sum inside the K loop."""
    return _impl("int8_linear", x)(x, qweight, scale, bias)


def lora_delta(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    """Batched multi-LoRA: x [T, K], stacked adapters a [S, R, K] and b [S, R, N] (scaling folded
    into b; slot 0 all zeros, the base model), each token's slot [T] -> [T, N], row t being
    x[t] @ a[slots[t]].T @ b[slots[t]] in x's dtype, accumulated in fp32."""
    return _impl("lora_delta", x)(x, a, b, slots)
