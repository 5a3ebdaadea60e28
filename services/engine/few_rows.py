"""The fastest CPU matmul for a few rows: a speculative verification (1 + k tokens at batch 1)
or a small decode batch.

On the CPU a matmul of 2-8 rows can cost far more than one row although it reads the same
weight: the BLAS switches from GEMV to a GEMM that repacks the large weight operand on every
call. Measured on issue 26's machine (SmolLM2-135M's projections and LM head, fp32, one
thread): 4 rows cost 1.8x one row and 8 rows 2.4x, which made every draft beyond the second
look too dear to adaptive K. Three forms compete:

- ``usual``: ``x @ weight.T``;
- ``flipped``: ``(weight @ x.T).T``, up to twice as fast at 2-6 rows on issue 17's machine;
- ``packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, what inductor uses for CPU
  linears), the weight packed once for a row count of 4 or 8 and the rows zero-padded up to it.
  Here 4 rows cost 1.2x one row and 8 rows 1.4x.

Which wins depends on the CPU, so each row count is timed once per process on the first layer
that meets it, and the winner serves every layer from then on. A packed weight is an extra
copy of the weight (one per pack size in use), made only where packing won.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

FEW_ROWS = range(2, 9)  # one row is a GEMV (fast in any form); from ~9 rows GEMM amortises
PACK_SIZES = (4, 8)  # rows are padded up to the next of these for the packed form
_FORM: dict[int, str] = {}  # row count -> the form that won the timing


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def pack_size(rows: int) -> int:
    return next(p for p in PACK_SIZES if p >= rows)


class FewRowsLinear:
    """The few-rows forms of one linear layer (its weight, bias and packed copies)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self._version = weight._version  # packed copies are stale once the weight is written
        self._packed: dict[int, torch.Tensor] = {}

    def serves(self, weight: torch.Tensor) -> bool:
        return weight is self.weight and weight._version == self._version

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T + bias`` in the fastest form for its row count, or None where the
        caller's own form is as good (CUDA, one row, many rows)."""
        rows = x.shape[0]
        if x.is_cuda or x.dim() != 2 or rows not in FEW_ROWS:
            return None
        form = _FORM.get(rows) or self._time_forms(x)
        if form == "usual":
            return None
        if form == "flipped":
            out = torch.mm(self.weight, x.t()).t()
            return (out + self.bias if self.bias is not None else out).contiguous()
        return self._packed_mm(x)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        rows, size = x.shape[0], pack_size(x.shape[0])
        packed = self._packed.get(size)
        if packed is None:
            packed = self._packed[size] = torch.ops.mkl._mkl_reorder_linear_weight(
                self.weight, size
            )
        if rows < size:
            x = torch.cat([x, x.new_zeros(size - rows, x.shape[1])])
        out = torch.ops.mkl._mkl_linear(x, packed, self.weight, self.bias, size)
        return out[:rows]

    def _time_forms(self, x: torch.Tensor) -> str:
        forms: dict[str, Callable[[], object]] = {
            "usual": lambda: torch.mm(x, self.weight.t()),
            "flipped": lambda: torch.mm(self.weight, x.t()).t().contiguous(),
        }
        if can_pack(self.weight) and not x.requires_grad:
            forms["packed"] = lambda: self._packed_mm(x)
            self._packed_mm(x)  # packs outside the timing
        best = min(forms, key=lambda name: min(_seconds(forms[name]) for _ in range(5)))
        _FORM[x.shape[0]] = best
        return best


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
