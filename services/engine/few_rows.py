"""The fastest CPU matmul for a few rows: a speculative verification (1 + k tokens at batch 1)
or a small decode batch.

On the CPU a matmul of 2-8 rows can cost far more than one row although it reads the same
weight: the BLAS switches from GEMV to a GEMM that repacks the large weight operand on every
call. Measured on issue 26's machine (SmolLM2-135M's projections and LM head, fp32, one
thread): 4 rows cost 1.75x one row and 5 rows 1.85x, which made every draft beyond the second
look too dear to adaptive K. Three forms compete:

- ``usual``: ``x @ weight.T``;
- ``flipped``: ``(weight @ x.T).T``, up to twice as fast at 2-6 rows on issue 17's machine;
- ``packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, what inductor uses for CPU
  linears) on a copy of the weight packed once; 4 rows then cost 1.2x one row, 5 rows 1.3x.

Which wins depends on the CPU, so each row count is timed once per process, and the winner
serves every layer from then on. An engine times them while it loads (``choose_forms``, on one
of its decoder layers), never in a step: timed on the first layer that met a row count, the
forms were timed on the 113 MB LM head of SmolLM2, where a prompt batch or a decode batch first
reached 2-7 rows, and each new row count stalled that step by 2-3 s (issue 49's calibration
found it: the real stack's TTFT and ITL means 1.3-2x the simulator's from these outliers). The
packed copy doubles the weights' memory, so it is made only where packing won; the LM head's is
made at start too (``prepare``), as packing 113 MB costs a step ~0.2 s.

Column-major float32 weights (the CPU layout, ``model_setup.lay_out_for_gemv``) never get here at
1-4 rows: ``kernels/cpu_gemv.py`` reads them once for all the rows, eagerly and in the compiled
decode step (``Linear.forward``). These forms serve 5-7 rows, and other layouts and dtypes.

Packing is offered up to 5 rows, a batch-1 verification of up to 4 drafts. At 6-8 rows it wins
too (8 rows: 1.4x one row against 2.4x), which makes plain decoding of a batch of 8 about twice
as fast, but the verification steps of such a batch (9-40 rows) cannot use it, and adaptive K,
pricing a draft from the step sizes around it, then drafts where it no longer pays (open-ended
work at batch 8 measured 0.60x of no speculation). Taking that gain needs a cost model that
prices the jump after 8 rows for the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

FEW_ROWS = range(2, 8)  # one row is a GEMV (fast in any form); from ~8 rows GEMM amortises
MAX_PACKED_ROWS = 5  # see above
PACKED_FOR = 8  # the row count the weight is packed for: the packed form serves 1-8 rows alike
_FORM: dict[int, str] = {}  # row count -> the form that won the timing


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


class FewRowsLinear:
    """The few-rows forms of one linear layer (its weight, its bias, its packed copy)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self._version = weight._version  # the packed copy is stale once the weight is written
        self._packed: torch.Tensor | None = None

    def serves(self, weight: torch.Tensor) -> bool:
        return weight is self.weight and weight._version == self._version

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T + bias`` in the fastest form for its row count, or None where the
        caller's own form is as good (CUDA, one row, many rows)."""
        rows = x.shape[0]
        if x.is_cuda or x.dim() != 2 or rows not in FEW_ROWS:
            return None
        form = _FORM.get(rows) or self._time_forms(x)
        if form == "usual" or (form == "packed" and not can_pack(self.weight)):
            # the forms are timed once per process, on the first engine's float32 weights: an
            # engine of float64 weights in the same process (the HF-oracle tests) cannot pack
            return None
        if form == "flipped":
            out = torch.mm(self.weight, x.t()).t()
            return (out + self.bias if self.bias is not None else out).contiguous()
        return self._packed_mm(x)

    def _pack(self) -> torch.Tensor:
        packed = self._packed
        if packed is None:
            packed = self._packed = torch.ops.mkl._mkl_reorder_linear_weight(
                self.weight, PACKED_FOR
            )
        return packed

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self._pack(), self.weight, self.bias, x.shape[0])

    def prepare(self) -> None:
        """Pack the weight now where a chosen form packs (call after ``choose_forms``)."""
        if "packed" in _FORM.values() and can_pack(self.weight):
            self._pack()

    def _time_forms(self, x: torch.Tensor) -> str:
        forms: dict[str, Callable[[], object]] = {
            "usual": lambda: torch.mm(x, self.weight.t()),
            "flipped": lambda: torch.mm(self.weight, x.t()).t().contiguous(),
        }
        if x.shape[0] <= MAX_PACKED_ROWS and can_pack(self.weight) and not x.requires_grad:
            forms["packed"] = lambda: self._packed_mm(x)
            self._packed_mm(x)  # packs outside the timing
        best = min(forms, key=lambda name: min(_seconds(forms[name]) for _ in range(5)))
        _FORM[x.shape[0]] = best
        return best


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def choose_forms(weight: torch.Tensor) -> None:
    """Time every few-row count on ``weight`` (a decoder layer's) now, where no request waits;
    row counts already timed in this process keep their form."""
    if weight.is_cuda or weight.dtype not in (torch.float32, torch.float64):
        return
    probe = FewRowsLinear(weight, None)
    for rows in FEW_ROWS:
        if rows not in _FORM:
            probe._time_forms(torch.randn(rows, weight.shape[1], dtype=weight.dtype))
