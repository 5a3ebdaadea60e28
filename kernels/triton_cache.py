"""KV-cache write: scatter each new token's K and V into its paged-cache slot."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_heads,
    head_dim,
    block_size,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
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
        k = tl.load(
            key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
            mask=mask,
        )
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(
            value_ptr
            + token * stride_value_token
            + heads[:, None] * stride_value_head
            + dims[None, :],
            mask=mask,
        )
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """See kernels.ops.store_kvcache. Caches may be the strided per-layer views."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride(), "K and V views must share one layout"
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // block_d))
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        head_dim,
        k_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
