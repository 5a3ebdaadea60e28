"""Batched LoRA, BGMV style: each token of the flat batch reads its own adapter's A and B
(``slots[t]``; slot 0 is the base model and is skipped), so sequences of different adapters and
of none share one launch pair with no grouping on the host.

Two kernels: the shrink, one program per token, makes v = x[t] @ A[s].T (R <= 64 values, fp32)
walking K in blocks; the expand, one program per (token, block of N outputs), makes
v @ B[s][:, block]. A base-model token's programs return at once, so a batch of base requests
pays two near-empty launches."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    v_ptr,
    K,
    stride_xt,
    stride_as,
    stride_ar,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    ranks = tl.arange(0, RANK)
    acc = tl.zeros((RANK,), dtype=tl.float32)
    if slot != 0:
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + kk, mask=kk < K, other=0.0)
            a = tl.load(
                a_ptr + slot * stride_as + ranks[:, None] * stride_ar + kk[None, :],
                mask=kk[None, :] < K,
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(v_ptr + t.to(tl.int64) * RANK + ranks, acc)


@triton.jit
def _lora_expand_kernel(
    v_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    N,
    stride_bs,
    stride_br,
    stride_ot,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot != 0:
        ranks = tl.arange(0, RANK)
        v = tl.load(v_ptr + t.to(tl.int64) * RANK + ranks)
        b = tl.load(
            b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
            mask=cols[None, :] < N,
            other=0.0,
        )
        acc = tl.sum(b.to(tl.float32) * v[:, None], axis=0)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + cols,
        acc.to(out_ptr.dtype.element_ty),
        mask=cols < N,
    )


def lora_delta(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    """x [T, K], a [S, R, K], b [S, R, N], slots [T] -> [T, N] (``reference_lora.lora_delta``)."""
    tokens, k = x.shape
    num_slots, rank, _ = a.shape
    n = b.shape[2]
    # tl.arange needs a power of two: pad the rank with zero rows of A and B
    padded = max(16, triton.next_power_of_2(rank))
    if padded != rank:
        a = torch.nn.functional.pad(a, (0, 0, 0, padded - rank))
        b = torch.nn.functional.pad(b, (0, 0, 0, padded - rank))
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    slots = slots.to(torch.int32).contiguous()
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    v = torch.empty(tokens, padded, dtype=torch.float32, device=x.device)
    block_n = 64
    # the kernels' constexprs (a typed dict: Triton's jit signature types them as constexpr)
    shrink: dict[str, Any] = {"RANK": padded, "BLOCK_K": 64}
    expand: dict[str, Any] = {"RANK": padded, "BLOCK_N": block_n}
    _lora_shrink_kernel[(tokens,)](
        x, a, slots, v, k, x.stride(0), a.stride(0), a.stride(1), **shrink
    )
    _lora_expand_kernel[(tokens, triton.cdiv(n, block_n))](
        v, b, slots, out, n, b.stride(0), b.stride(1), out.stride(0), **expand
    )
    return out
