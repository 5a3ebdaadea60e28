"""Symmetric INT8 weights, one scale per output channel or per group of input channels, and their
reference math.

Two layouts share ``Int8Weight``: per channel (scale [N], what ``quantize_per_channel`` makes and
the CPU W8A8 path needs) and group-wise (scale [N, K // G]: each run of G consecutive input
channels of a row has its own scale). GGUF's Q8_0 is the group-wise layout with G = 32 and float16
scales, so its blocks load as they are (services/engine/loader.py), without a float round trip.

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
    """W ~= qweight * scale; qweight [N, K] int8 in [-127, 127]. scale [N] float32 (per channel)
    or [N, K // G] (per group of G input channels; Q8_0 keeps its float16 scales, G = 32)."""

    qweight: Tensor
    scale: Tensor

    @property
    def grouped(self) -> bool:
        return self.scale.dim() == 2

    @property
    def group_size(self) -> int:
        """G: input channels per scale (K for per-channel scales)."""
        k = self.qweight.shape[1]
        return k // self.scale.shape[1] if self.grouped else k

    def to(self, device: torch.device | str) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight; exact in float32 (an int8 times a float16 scale needs 19 bits)."""
        q = self.qweight.to(torch.float32)
        if not self.grouped:
            return (q * self.scale.to(torch.float32)[:, None]).to(dtype)
        n, k = q.shape
        groups = self.scale.shape[1]
        w = q.view(n, groups, k // groups) * self.scale.to(torch.float32)[..., None]
        return w.view(n, k).to(dtype)


def quantize_per_channel(weight: Tensor) -> Int8Weight:
    """Round-to-nearest symmetric INT8, one scale per row (output channel) of ``weight`` [N, K]."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    qweight = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(qweight, scale)


def quantize_groupwise(weight: Tensor, group_size: int) -> Int8Weight:
    """Round-to-nearest symmetric INT8, one float32 scale per ``group_size`` input channels.

    On a weight that already lies on a Q8_0 grid (dequantized Q8_0, G = 32) this gives the blocks
    back exactly: a block's largest value is 127 * d, so its scale comes out as d."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"{k} input channels do not split into groups of {group_size}")
    groups = w.view(n, k // group_size, group_size)
    scale = groups.abs().amax(dim=2).clamp(min=1e-12) / INT8_MAX
    q = torch.round(groups / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.view(n, k), scale)


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
    integers (int64) per scale group, as the CPU path computes it; else weight-only (W8A16), the
    dequantized weight times the unrounded activations in fp32, as the CUDA path computes it.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if dynamic:
        xq, xs = quantize_per_token(x2)
        g = weight.group_size
        m, k = xq.shape
        xg = xq.to(torch.int64).view(m, k // g, g).transpose(0, 1)  # [groups, M, G]
        wg = weight.qweight.to(torch.int64).view(-1, k // g, g).permute(1, 2, 0)  # [groups, G, N]
        acc = torch.bmm(xg, wg).to(torch.float64)  # [groups, M, N], exact
        scale = weight.scale.double().reshape(weight.scale.shape[0], -1).T  # [groups, N]
        y = (acc * scale[:, None, :]).sum(dim=0) * xs[:, None].double()
    else:
        y = x2.to(torch.float32) @ weight.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)
