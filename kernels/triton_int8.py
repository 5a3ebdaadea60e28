"""Weight-only INT8 linear (W8A16): y = x @ (qweight * scale).T, the INT8 weights converted in
registers. At decode batch sizes a linear layer is bound by reading its weights, so reading one
byte per weight instead of two (bf16) is the speed-up.

Two scale layouts, chosen by a constexpr so each compiles to its own kernel: per output channel
(scale [N], applied once to the fp32 accumulator after the K loop) and per group of G input
channels (scale [N, K // G], GGUF Q8_0 is G = 32): there a K step never straddles two groups
(BLOCK_K divides G), so each step's partial product is scaled by its group's scale and added."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _int8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # 0: one scale per output channel
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rows[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None],
            mask=(cols[None, :] < N) & (kk[:, None] < K),
            other=0,
        )
        if GROUP_SIZE == 0:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        else:
            group_scale = tl.load(
                scale_ptr + cols.to(tl.int64) * stride_sn + k0 // GROUP_SIZE,
                mask=cols < N,
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32)) * group_scale[None, :]
    if GROUP_SIZE == 0:
        scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


def int8_linear(x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """See pdserve.kernels.ops.int8_linear."""
    M, K = x.shape
    N = qweight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight = qweight.contiguous()
    scale = scale.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    # decode rows are few: a narrow M tile, wide N tiles, so the weight is read once per M tile
    block_m = 16 if M <= 16 else 64
    block_n, block_k = 64, 64
    group_size = 0
    if scale.dim() == 2:
        group_size = K // scale.shape[1]
        if group_size * scale.shape[1] != K or group_size < 16 or group_size & (group_size - 1):
            raise ValueError(f"group size {K}/{scale.shape[1]}: expected a power of two >= 16")
        block_k = min(block_k, group_size)  # a K step stays inside one group
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _int8_linear_kernel[grid](
        x,
        qweight,
        scale,
        bias if bias is not None else scale,
        out,
        M,
        N,
        K,
        x.stride(0),
        qweight.stride(0),
        scale.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
