"""Few-row linears over INT8, bfloat16 and float32 weights on an AVX2 CPU: ``kernels/cpu_gemv.cpp``
and ``kernels/cpu_colmajor.cpp``.

A decode step at batch 1-4 is a GEMV per layer, bound by reading the weights. On the AVX2 EPYC
of issue 42 (one thread, perf/gemv_bench.py) none of torch's kernels read 1- or 2-byte weights
near the bus: fbgemm's dynamic INT8 linear about half of a plain sum of the same bytes, ATen's
``_weight_int8pack_mm`` and an Inductor-compiled dequantizing reduction far less, oneDNN's bf16
matmul about 40%. The C++ loop widens the weights in registers and streams them once.

Float32 weights are stored column-major for MKL's one-row GEMV (``model_setup.lay_out_for_gemv``),
but MKL's GEMM of 2-4 rows over that layout read them at 40-60% of its GEMV's speed: a compiled
SmolLM2 decode step took 40 ms at batch 1, 69 at 2 and 107 at 4. ``f32_linear`` takes 1-4 rows
through a loop over the column-major layout that reads the weight once for all of them: a pass
over SmolLM2's linears took 24.1 / 26.3 / 28.6 / 31.3 ms at 1-4 rows, against MKL's 28.5 / 47.1 /
62.0 / 73.7 and 26.0-26.5 ms for a plain sum of the same bytes (``perf.gemv_bench``, one thread).

Built on first use with torch's extension builder (g++ and ninja) into ``$PDSERVE_EXT_DIR`` (default
``~/.cache/pdserve/ext``); an engine that will use it builds it while it loads its model
(``model_setup.build_rank_model``), never in a step. Only where the CPU has AVX2 and FMA
(``PDSERVE_NO_CPU_GEMV=1`` turns it off); ``available()`` is False elsewhere, or when the build
fails, and the callers keep their torch path. The ops are registered with torch.library so a
compiled decode step calls them as opaque ops (``torch.ops.pdserve.int8_gemv`` / ``bf16_gemv``).
The same extension holds the fused decoder (``cpu_decode.cpp``), the paged decode
attention of the larger compiled steps (``cpu_attention.cpp``, ``paged_attention``), and the
oneDNN-packed copies that float32 linears of PACKED_FROM_ROWS rows and more run on
(``cpu_packed_gemm.cpp``, ``pack_gemm``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# the most rows the INT8 kernel takes (one pass over the weight): above it, fbgemm's GEMM, and
# the fused decoder (cpu_decode.cpp) of an INT8 model hands the step to the graphs
MAX_ROWS = 4
# ... and the bfloat16 kernel: above it, oneDNN's matmul (cpu_gemv.h's kBf16Rows)
MAX_BF16_ROWS = 8
# float32 column-major weights only: up to this many rows the kernel (cpu_colmajor.cpp) beats MKL's
# GEMM, which copies the column-major weight into its packed form on every call (cpu_gemv.h)
MAX_GEMM_ROWS = 24
# ... except from this many rows where the weight has a oneDNN-packed copy (``pack_gemm``): it
# serves them (cpu_gemv.h's kPackedFromRows)
PACKED_FROM_ROWS = 5

_SOURCES = [
    Path(__file__).resolve().with_name(n)
    for n in (
        "cpu_gemv.cpp",
        "cpu_colmajor.cpp",
        "cpu_decode.cpp",
        "cpu_attention.cpp",
        "cpu_ops.cpp",
        "cpu_packed_gemm.cpp",
    )
]
# -fopenmp: at::parallel_for is inline OpenMP, serial without it (it links torch's own libgomp)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build_dir() -> Path:
    # not under $PDSERVE_CACHE_DIR: tests point that at fresh folders, and a build costs a
    # minute of a loaded 2-vCPU machine; torch rebuilds when the source changes. One folder per
    # checkout: torch's build file names the sources by absolute path, so two checkouts sharing
    # a folder (a clone's CI run beside the working tree) rebuilt it in turn under one lock
    base = os.environ.get("PDSERVE_EXT_DIR") or Path.home() / ".cache" / "pdserve" / "ext"
    checkout = hashlib.sha1(str(_SOURCES[0].parent).encode()).hexdigest()[:8]
    out = Path(base) / f"cpu_gemv-torch{torch.__version__.split('+')[0]}-{checkout}"
    out.mkdir(parents=True, exist_ok=True)
    return out


@functools.cache
def _module() -> object | None:
    if os.environ.get("PDSERVE_NO_CPU_GEMV") or not _cpu_has_avx2():
        return None
    from torch.utils import cpp_extension

    # the extension registers the CPU kernels of ops defined in Python: define them all first
    from pdserve.kernels import graph_ops  # noqa: F401

    _put_ninja_on_path()
    try:
        return cpp_extension.load(
            name="pdserve_cpu_gemv",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja
        log.warning("the AVX2 GEMV kernel did not build (%s): INT8/bf16 decode keeps torch's", exc)
        return None


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; pdserve depends on the ``ninja`` wheel, whose
    binary sits in the venv, which a process started as ``.venv/bin/python`` lacks on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, os.environ.get("PATH"))))


def available() -> bool:
    """Whether the kernel is built (building it the first time) and this CPU can run it."""
    return _module() is not None


_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define("int8_gemv(Tensor x, Tensor qweight, Tensor scale) -> Tensor")
_LIB.define("bf16_gemv(Tensor x, Tensor weight) -> Tensor")
_LIB.define("cpu_f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _kernel() -> Any:
    module = _module()
    if module is None:
        raise RuntimeError("the AVX2 GEMV kernel is not available here (see available())")
    return module


def _int8_gemv(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    return _kernel().int8_gemv(x.contiguous(), qweight, scale)


def _bf16_gemv(x: Tensor, weight: Tensor) -> Tensor:
    return _kernel().bf16_gemv(x.contiguous(), weight)


_LIB.impl("int8_gemv", _int8_gemv, "CompositeExplicitAutograd")
_LIB.impl("bf16_gemv", _bf16_gemv, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::int8_gemv")
def _int8_gemv_fake(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.register_fake("pdserve::bf16_gemv")
def _bf16_gemv_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def int8_gemv(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """(x @ qweight.T) * scale: float32 x [B, K], int8 qweight [N, K], float32 scale [N]."""
    return torch.ops.pdserve.int8_gemv(x, qweight, scale)


def int8_gemv_now(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """``int8_gemv`` called directly, for code already inside an opaque op or running eagerly:
    the dispatcher's hop to the Python impl costs ~5 us, 121 times a SmolLM2 step."""
    return _int8_gemv(x, qweight, scale)


def bf16_gemv(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T in float32: float32 x [B, K], bfloat16 weight [N, K]."""
    return torch.ops.pdserve.bf16_gemv(x, weight)


# a bfloat16 linear layer whose row count is known only at run time (a compiled decode step's
# dynamic batch): the choice is made inside one opaque op, as a branch in the graph would guard
# the batch size and recompile
_LIB.define("cpu_bf16_linear(Tensor x, Tensor weight) -> Tensor")


def _cpu_bf16_linear(x: Tensor, weight: Tensor) -> Tensor:
    x2 = x.reshape(-1, weight.shape[1])
    if x2.shape[0] <= MAX_BF16_ROWS:
        y = _bf16_gemv(x2.float(), weight).to(x.dtype)
    else:
        y = torch.nn.functional.linear(x2, weight)
    return y.reshape(*x.shape[:-1], weight.shape[0])


_LIB.impl("cpu_bf16_linear", _cpu_bf16_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::cpu_bf16_linear")
def _cpu_bf16_linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` of a bfloat16 ``weight`` [N, K]: up to MAX_BF16_ROWS rows of x through the AVX2
    kernel (float32 accumulation, as oneDNN's, the result rounded to x's dtype), more through
    ``F.linear``. Call only where ``available()``."""
    y = torch.ops.pdserve.cpu_bf16_linear(x, weight)
    return y if bias is None else y + bias


def f32_rows(rows: int, packed: bool = False) -> bool:
    """Whether the float32 kernel takes a matmul of this many rows: 1 to MAX_GEMM_ROWS (above
    it, MKL's GEMM), or fewer than PACKED_FROM_ROWS where the weight has a ``packed`` copy."""
    return 1 <= rows < PACKED_FROM_ROWS if packed else 1 <= rows <= MAX_GEMM_ROWS


def f32_linear_now(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` of a column-major float32 ``weight`` [N, K] over 1-MAX_GEMM_ROWS rows of a 2-D
    float32 ``x``, through the kernel, called directly (eager: no dispatcher hop)."""
    y = _kernel().f32_colmajor_gemv(x.contiguous(), weight)
    return y if bias is None else y + bias


# the row count oneDNN is told to expect when it chooses the packed layout: a hint only, the
# copy serves any row count (measured 25-512 rows, perf/README.md)
PACK_HINT_ROWS = 64


def can_pack_gemm(weight: Tensor) -> bool:
    """Whether ``pack_gemm`` can give this weight a oneDNN copy: a 2-D float32 CPU weight where
    the extension built and torch has oneDNN."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and available()
    )


def pack_gemm(weight: Tensor) -> Tensor:
    """Give a float32 weight [N, K] a copy in oneDNN's blocked layout, which ``f32_linear``
    then uses for PACKED_FROM_ROWS rows and more (cpu_packed_gemm.cpp: found by the weight's
    address while its storage lives); returns the copy. Call only where ``can_pack_gemm``."""
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)
    _kernel().register_packed_gemm(weight, packed)
    return packed


def packed_gemm_count() -> int:
    """Weights with a live packed copy (tests; freed weights drop out)."""
    return _kernel().packed_gemm_count() if available() else 0


def packed_gemm_calls() -> int:
    """Products made on packed copies so far, in this process (tests: which path a step took)."""
    return _kernel().packed_gemm_calls() if available() else 0


def _cpu_f32_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if f32_rows(x.shape[0]):
        return f32_linear_now(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


_LIB.impl("cpu_f32_linear", _cpu_f32_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::cpu_f32_linear")
def _cpu_f32_linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def f32_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``f32_linear_now`` as one opaque op, for a compiled step whose row count is known only at
    run time (a dynamic batch): oneDNN's GEMM on the weight's packed copy from PACKED_FROM_ROWS
    rows where it has one, else the kernel for 1-MAX_GEMM_ROWS rows and ``F.linear`` above, each
    with the bias as the eager path adds it. Call only where ``available()``."""
    return torch.ops.pdserve.cpu_f32_linear(x, weight, bias)


# paged decode attention over one layer's block-major pages, read in place (cpu_attention.cpp):
# a compiled decode step's attention where the extension is built
_LIB.define(
    "paged_attention(Tensor q, Tensor pages, Tensor block_tables, Tensor context_lens,"
    " float scale) -> Tensor"
)


def _paged_attention(
    q: Tensor, pages: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    return _kernel().paged_attention(q, pages, block_tables, context_lens, scale)


_LIB.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _paged_attention_fake(
    q: Tensor, pages: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    return q.new_empty(q.shape)


def paged_attention(
    q: Tensor, pages: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """``paged_decode.paged_decode_attention`` of q [B, Hq, D] over one layer's float32 or
    bfloat16 pages [blocks, 2, block_size, Hk, D] (block-major: ``graph_ops.fits``), as one
    opaque op whose C++ kernel reads each row's blocks in place, a task per row (per row and KV
    head where there are fewer rows than threads) on every thread. Call only where
    ``available()``."""
    return torch.ops.pdserve.paged_attention(q, pages, block_tables, context_lens, scale)
