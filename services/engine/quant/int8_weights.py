"""Symmetric INT8 quantization with one scale per output channel, and its reference math.

The reference (``int8_linear_reference``) is what every fast path is tested against: it rounds the
activations per token to INT8 exactly as the dynamic CPU path does, multiplies in exact integer
arithmetic and scales back, so a kernel's error can be bounded per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INT8_MAX = 127


@dataclass
class Int8Weight:
    """W ~= qweight * scale[:, None]; qweight [N, K] int8 in [-127, 127], scale [N] float32."""

    qweight: Tensor
    scale: Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)


def quantize_per_channel(weight: Tensor) -> Int8Weight:
    """Round-to-nearest symmetric INT8, one scale per row (output channel) of ``weight`` [N, K]."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    qweight = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(qweight, scale)


def quantize_per_token(x: Tensor, qmax: int = INT8_MAX) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric activation quantization: x [M, K] -> (int8 [M, K], scale [M] fp32)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=1).clamp(min=1e-12) / qmax
    q = torch.round(xf / scale[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def int8_linear_reference(
    x: Tensor, weight: Int8Weight, bias: Tensor | None = None, dynamic: bool = True
) -> Tensor:
    """y = x @ W.T (+ bias) with INT8 weights, in x's dtype.

    dynamic: W8A8 - activations rounded per token to INT8 and the product summed in exact
    integers (int64), as the CPU path computes it; else weight-only (W8A16), the dequantized
    weight times the unrounded activations in fp32, as the CUDA path computes it.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if dynamic:
        xq, xs = quantize_per_token(x2)
        acc = xq.to(torch.int64) @ weight.qweight.to(torch.int64).T
        y = acc.to(torch.float64) * xs[:, None].double() * weight.scale[None, :].double()
    else:
        y = x2.to(torch.float32) @ weight.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)
