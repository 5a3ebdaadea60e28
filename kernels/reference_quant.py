"""Plain-torch twins of the quantized ops: INT8 weight-only linear and the quantized KV cache.

KV cache quantization is per token and KV head: each stored K (and V) vector of D values gets
one float32 scale, amax / QMAX, so a token's write never rescales what is already in its block
(per-block scales would, or would need the block's future tokens). Element types: int8
(QMAX 127, rounded) and float8_e4m3fn (QMAX 448, cast). The scales live in the same cache block as
the values (services/engine/quant/kv_cache.py), so a block copied as bytes carries them.
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (values [..., D] of ``dtype``, scales [...] float32); x ~= values * scale."""
    xf = x.to(torch.float32)
    qmax = KV_QMAX[dtype]
    amax = xf.abs().amax(dim=-1).clamp(min=1e-8)
    # a tensor divisor: torch on CUDA divides by a Python scalar as a multiply by its reciprocal,
    # one ulp off the IEEE quotient the Triton store computes (div_rn)
    scale = amax / torch.full_like(amax, qmax)
    scaled = xf / scale[..., None]
    if dtype == torch.int8:
        scaled = torch.round(scaled).clamp(-qmax, qmax)
    return scaled.to(dtype), scale


def dequantize_kv(values: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """values [..., D] times scales [...] in ``dtype``; a float cache (scales None) is only cast."""
    if scales is None:
        return values.to(dtype)
    return (values.to(torch.float32) * scales[..., None]).to(dtype)


def int8_linear(x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """Weight-only INT8: x [M, K] @ (qweight [N, K] int8 * scale).T (+ bias) -> [M, N] in x's
    dtype, accumulated in fp32 (fp64 for fp64 inputs). scale [N]: one per output channel, applied
    to the product; scale [N, K // G]: one per group of G input channels, applied to the weight
    (the twin dequantizes it, the exact float weight a group-wise format such as Q8_0 stands for)."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    if scale.dim() == 1:
        y = (x.to(cdt) @ qweight.to(cdt).T) * scale.to(cdt)
    else:
        n, k = qweight.shape
        groups = scale.shape[1]
        w = qweight.to(cdt).view(n, groups, k // groups) * scale.to(cdt)[..., None]
        y = x.to(cdt) @ w.view(n, k).T
    if bias is not None:
        y = y + bias.to(cdt)
    return y.to(x.dtype)
