"""RMSNorm with the residual add fused in: one read of x (and residual), one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as the unfused model's `x + residual` does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    """2-D with unit column stride; rows may be strided (e.g. a slice of a wider buffer)."""
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """See pdserve.kernels.ops.rms_norm. Leading dims beyond [T, H] are flattened and restored."""
    if x.dim() != 2:
        out, new_residual = rms_norm(
            _rows(x), weight, eps, _rows(residual) if residual is not None else None
        )
        return out.view(x.shape), new_residual.view(x.shape) if new_residual is not None else None
    x = _rows(x)
    num_rows, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = None
    if residual is not None:
        residual = _rows(residual)
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        new_residual if new_residual is not None else out,
        hidden,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        new_residual.stride(0) if new_residual is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual
