"""KV-cache write: scatter each new token's K and V into its paged-cache slot.

A quantized cache (int8 or float8_e4m3fn values, kernels/reference_quant.py) is written in the
same pass: each (token, kv head) vector's amax gives its one float32 scale, amax / QMAX, and the
values stored are x / scale, rounded half to even for int8 (as torch.round) and cast (round to
nearest even, saturating) for fp8: byte for byte what kernels/reference_quant.quantize_kv stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.triton_attention_common import scale_strides

# Adding then subtracting 1.5 * 2**23 rounds an fp32 of magnitude < 2**22 to the nearest integer,
# ties to even (IEEE round-to-nearest of the sum), which is torch.round exactly; the interpreter
# has no libdevice.rint. Nothing reassociates the two adds (no fast-math).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _quantize_rows(x, qmax, element_ty: tl.constexpr):
    """x [H, D] fp32 (zeros where masked) -> (values [H, D] of element_ty, scales [H] fp32)."""
    # IEEE-rounded divisions, as torch's: a plain `/` compiles to div.full.f32 (2 ulp) on NVIDIA.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8), qmax)
    scaled = tl.math.div_rn(x, scale[:, None])
    if element_ty == tl.int8:
        scaled = (scaled + _ROUND_MAGIC) - _ROUND_MAGIC
        scaled = tl.minimum(tl.maximum(scaled, -qmax), qmax)
    return scaled.to(element_ty), scale


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    num_heads,
    head_dim,
    block_size,
    qmax,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    KV_QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Slot -1: this token's K/V is already cached (prefix hit); mask every access off.
    heads_to_write = tl.where(slot >= 0, num_heads, 0)
    block = slot // block_size
    offset = slot % block_size
    dims = tl.arange(0, BLOCK_D)
    for head_start in range(0, num_heads, BLOCK_H):
        heads = head_start + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < heads_to_write) & (dims[None, :] < head_dim)
        dst = (
            block * stride_cache_block
            + offset * stride_cache_offset
            + heads[:, None] * stride_cache_head
            + dims[None, :]
        )
        k_src = (
            key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
        )
        v_src = (
            value_ptr
            + token * stride_value_token
            + heads[:, None] * stride_value_head
            + dims[None, :]
        )
        if KV_QUANT:
            # Padded heads and dims load as 0, so they never raise a vector's amax.
            element_ty: tl.constexpr = k_cache_ptr.dtype.element_ty
            scale_dst = (
                block * stride_scale_block
                + offset * stride_scale_offset
                + heads * stride_scale_head
            )
            head_mask = heads < heads_to_write
            k = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
            k_q, k_scale = _quantize_rows(k, qmax, element_ty)
            tl.store(k_cache_ptr + dst, k_q, mask=mask)
            tl.store(k_scale_ptr + scale_dst, k_scale, mask=head_mask)
            v = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
            v_q, v_scale = _quantize_rows(v, qmax, element_ty)
            tl.store(v_cache_ptr + dst, v_q, mask=mask)
            tl.store(v_scale_ptr + scale_dst, v_scale, mask=head_mask)
        else:
            k = tl.load(k_src, mask=mask)
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v = tl.load(v_src, mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# element type -> QMAX (kernels/reference_quant.KV_QMAX, restated so no import reaches the twins)
_KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def store_kvcache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """See pdserve.kernels.ops.store_kvcache. Caches (and scales) may be the strided per-layer views."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride(), "K and V views must share one layout"
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    quantized = k_scale is not None
    if quantized:
        assert k_cache.dtype in _KV_QMAX and v_cache.dtype == k_cache.dtype, k_cache.dtype
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // block_d))
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scale if quantized else k_cache,  # unused for a float cache
        v_scale if quantized else v_cache,
        slot_mapping,
        num_heads,
        head_dim,
        k_cache.shape[1],
        _KV_QMAX.get(k_cache.dtype, 1.0),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides(k_scale, v_scale),
        KV_QUANT=quantized,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
