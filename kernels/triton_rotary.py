"""Rotary embedding (neox "rotate_half" style) applied in place to q and k in one launch."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    num_heads,
    cos,
    sin,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < half
    for head_start in range(0, num_heads, BLOCK_H):
        heads = head_start + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & dim_mask[None, :]
        base = x_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + half, mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        tl.store(base, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
        tl.store(base + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    num_q_heads,
    num_k_heads,
    half,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cache,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < half
    cos = tl.load(cache_ptr + position * stride_cache + dims, mask=dim_mask, other=0.0)
    sin = tl.load(cache_ptr + position * stride_cache + half + dims, mask=dim_mask, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr, token, stride_q_token, stride_q_head, num_q_heads, cos, sin, half, BLOCK_H, BLOCK_D
    )
    _rotate_heads(
        k_ptr, token, stride_k_token, stride_k_head, num_k_heads, cos, sin, half, BLOCK_H, BLOCK_D
    )


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> None:
    """See pdserve.kernels.ops.rotary_embedding. q and k may be strided views (e.g. of a fused qkv)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    # The kernel writes through the given strides; only the head dim must be unit-stride.
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs unit stride in the head dim"
    assert cos_sin_cache.stride(-1) == 1
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, k.shape[1])), 4096 // block_d))
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        num_q_heads,
        k.shape[1],
        half,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
