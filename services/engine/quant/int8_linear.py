"""``nn.Linear`` replacements with INT8 weights, one per device, and the swap that installs them.

Chosen by measurement on the reference CPU (perf/int8_linear_bench.py, perf/README.md; 2 threads,
AVX-512 VNNI, torch 2.13): fbgemm's dynamic linear with a prepacked weight
(``torch.ops.quantized.linear_dynamic``: per-token activation rounding, per-channel INT8 weights,
int32 accumulation) ran SmolLM2's shapes 1.0-12.8x faster than fp32 (the 49,152-wide head most),
while ``aten._weight_int8pack_mm`` (weight-only) was slower than fp32, ``torch._int_mm`` needs 17+
rows and a separate activation pass, and torchao 0.18 (the release for torch 2.13) was slower than
fp32 eager on every shape and compiled on the MLP's. On an AVX2 CPU without VNNI (issue 42's EPYC,
one thread, perf/gemv_bench.py) fbgemm's op read the weights at ~60% of a plain sum of the same
bytes at batch 1, so up to 4 rows (a decode step) go to ``kernels/cpu_gemv.cpp`` instead: the same
per-token W8A8 math (symmetric 8-bit rounding, exact integer sums, as ``int8_linear_reference``), at
~75% of the sum; prompts and larger batches stay on fbgemm. On CUDA the weights stay INT8 and the
Triton weight-only kernel (``ops.int8_linear``) dequantizes them in registers: at decode sizes a
matmul is bound by reading the weights, which INT8 halves against bf16.

GGUF Q8_0 layers (int8 values, a float16 scale per 32 input channels) go onto the weight-only path
as they are: the loader builds ``WeightOnlyInt8Linear`` from the file's values and group scales,
no float weight in between (services/engine/loader.py). The CPU W8A8 path cannot: fbgemm takes
one scale per output channel, and SmoothQuant multiplies the float weight by per-input-channel
factors before rounding. There a Q8_0 layer takes the float route (dequantized exactly, smoothed,
rounded per channel), the same as any other checkpoint. Folding the blocks in the integer domain
instead (q' = round(q * d_block / s_row)) is that same rounding without smoothing, and measured
worse on SmolLM2-135M re-quantized to Q8_0 (384 tokens of perf/data/quality_text.txt, fp32 12
prompts x 24 tokens teacher-forced): perplexity 31.63 against 30.76 smoothed (fp32 30.07), top-1
agreement 88.5% against 93.1%; the weight-only group path gives 30.07 and 100%.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import weakref
from pathlib import Path

import torch
from torch import Tensor, nn

from pdserve.kernels import cpu_gemv, ops
from pdserve.services.engine.quant.int8_weights import Int8Weight, quantize_per_channel
from pdserve.services.engine.quant.smooth import activation_maxima, smoothing_scales


@functools.cache
def cpu_has_vnni() -> bool:
    """VNNI sums u8*s8 products straight into int32; without it fbgemm's int16 pair sums can
    saturate on full-range activations, so they must be rounded to 7 bits (reduce_range)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


# fbgemm's packed weights are a TorchScript object that Dynamo cannot trace, so a compiled decode
# step (services/engine/decode_graph.py) calls each layer's through one opaque op that names it by
# a handle tensor: an int would be baked into the graph, one graph per layer.
_PACKED: dict[int, object] = {}
_next_handle = itertools.count()


def _int8_rows(
    x: Tensor, qweight: Tensor, scale: Tensor, packed: object, reduce_range: bool
) -> Tensor:
    """x [B, K] float32 (already smoothed) against one layer's INT8 weight.

    Up to ``cpu_gemv.MAX_ROWS`` rows (a decode step at batch 1-4) go to the AVX2 kernel
    (``kernels/cpu_gemv.cpp``): each row rounded to int8 with its own symmetric scale and
    multiplied in exact integers, reading the weight once at near the bus's speed; fbgemm's
    op read it at ~60% of that (perf/README.md, issue 42). More rows (prompts, larger batches)
    go to fbgemm's prepacked GEMM."""
    if x.shape[0] <= cpu_gemv.MAX_ROWS and cpu_gemv.available():
        return cpu_gemv.int8_gemv_now(x, qweight, scale)
    if x.shape[0] == 1:
        # one row: fbgemm's one scale is the per-token scale already, and the four small ops
        # below were a quarter of the layer's time
        return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)
    # fbgemm rounds the whole input with one scale; a prompt's rows differ in range by 100x (and
    # SmolLM2 has outlier tokens), so each row is first brought to amax 1: one scale for all is
    # then the per-token scale, and the rows' amax multiply the result back.
    row_max = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
    return torch.ops.quantized.linear_dynamic(x / row_max, packed, reduce_range) * row_max


# Registered through torch.library.Library, not ``custom_op``: ~3 us a call against ~16 us,
# 121 calls a SmolLM2 decode step (1.7 ms of an 18 ms INT8 step, measured)
_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define(
    "cpu_int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor handle, bool reduce_range)"
    " -> Tensor"
)


def _cpu_int8_linear(
    x: Tensor, qweight: Tensor, scale: Tensor, handle: Tensor, reduce_range: bool
) -> Tensor:
    """``_int8_rows`` with fbgemm's packed weight named by ``handle``. One opaque op, so the
    choice by row count is made at run time: a branch in the traced graph would guard the
    dynamic batch size, and recompile."""
    return _int8_rows(x, qweight, scale, _PACKED[int(handle)], reduce_range)


_LIB.impl("cpu_int8_linear", _cpu_int8_linear, "CPU")


@torch.library.register_fake("pdserve::cpu_int8_linear")
def _cpu_int8_linear_fake(
    x: Tensor, qweight: Tensor, scale: Tensor, handle: Tensor, reduce_range: bool
) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


class CpuInt8Linear(nn.Module):
    """W8A8 dynamic: each token's activations rounded to int8 on the fly, by the AVX2 kernel at
    up to 4 rows, by fbgemm above (``_int8_rows``)."""

    def __init__(
        self,
        weight: Int8Weight,
        bias: Tensor | None,
        out_dtype: torch.dtype,
        smooth: Tensor | None = None,
    ) -> None:
        """smooth: SmoothQuant's per-input-channel s [K] (services/engine/quant/smooth.py),
        already multiplied into ``weight`` before rounding; the input is divided by it here."""
        super().__init__()
        if weight.grouped:
            raise ValueError("fbgemm's INT8 linear takes one scale per output channel")
        self.inv_smooth = None if smooth is None else (1.0 / smooth).float()
        self.out_features, self.in_features = weight.qweight.shape
        self.out_dtype = out_dtype
        self.reduce_range = not cpu_has_vnni()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(
            weight.qweight, weight.scale.double(), zero_points, 0
        )
        # the bias is added after the per-token rescale below, so it is not packed
        self.bias = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        handle = next(_next_handle)
        _PACKED[handle] = self._packed
        weakref.finalize(self, _PACKED.pop, handle, None)
        self._handle = torch.tensor(handle)
        # the AVX2 kernel's operands (few rows); plain attributes, not buffers: the roofline
        # counts one weight read a step (step_cost.stored_bytes), and a few rows read these
        self.qweight = weight.qweight.contiguous()
        self.scale = weight.scale.float().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:  # the dynamic kernels take fp32 activations only
            x2 = x2.float()
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        if torch.compiler.is_compiling():
            y = torch.ops.pdserve.cpu_int8_linear(
                x2, self.qweight, self.scale, self._handle, self.reduce_range
            )
        else:
            y = _int8_rows(x2, self.qweight, self.scale, self._packed, self.reduce_range)
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 dynamic (fbgemm, avx2)"


class WeightOnlyInt8Linear(nn.Module):
    """W8A16: INT8 weights dequantized inside the matmul kernel (``ops.int8_linear``); scales per
    output channel or per group of input channels (GGUF Q8_0's, kept as float16)."""

    def __init__(self, weight: Int8Weight, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self.group_size = weight.group_size
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        y = ops.int8_linear(x.reshape(-1, self.in_features), self.qweight, self.scale, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        groups = "" if self.group_size == self.in_features else f", groups of {self.group_size}"
        return f"in={self.in_features}, out={self.out_features}, int8 weight-only{groups}"


def uses_weight_only(device: torch.device, weight_only: bool | None = None) -> bool:
    """The layers' kind: W8A8 (fbgemm) on the CPU, weight-only elsewhere, unless chosen (tests
    take the weight-only path on a CPU machine; it then runs the plain-torch twin)."""
    return device.type != "cpu" if weight_only is None else weight_only


def int8_module(
    linear: nn.Linear,
    device: torch.device,
    dtype: torch.dtype,
    act_max: Tensor | None = None,
    weight_only: bool | None = None,
) -> nn.Module:
    """The INT8 replacement of ``linear`` on ``device``; act_max [K] (CPU W8A8 only): the
    calibrated input maxima that SMOOTH_ALPHA smooths against."""
    if not uses_weight_only(device, weight_only):
        smooth = None
        w = linear.weight.detach().float()
        if act_max is not None and SMOOTH_ALPHA is not None:
            smooth = smoothing_scales(act_max, w, SMOOTH_ALPHA)
            w = w * smooth
        return CpuInt8Linear(quantize_per_channel(w), linear.bias, dtype, smooth)
    return WeightOnlyInt8Linear(quantize_per_channel(linear.weight).to(device), linear.bias)


# The vocabulary head is quantized too: at batch 1 it is the largest single matmul (49,152 x 576
# for SmolLM2, ~40% of an fp32 decode step) and INT8 keeps the quality targets (perf/README.md).
# The embedding stays in the float dtype: a lookup of a few rows costs nothing to speed up.
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")

# Linear layers kept in the float dtype although their kind is quantized: fnmatch patterns over
# the module's full name ("lm_head", "*.down_proj", "layers.0.*"). Chosen by measurement on
# SmolLM2-135M-Instruct (perf/README.md, issue 18 section, per layer type).
FLOAT_LINEARS: tuple[str, ...] = ()

# SmoothQuant's migration strength on the CPU W8A8 path (None: no smoothing); 0.5 measured best on
# SmolLM2 (perf/README.md). It needs the calibration text's token ids, which only the model's
# tokenizer gives: the loader passes ``smooth.calibration_ids(model_dir)``; without them the
# layers are not smoothed.
SMOOTH_ALPHA: float | None = 0.5


def keeps_float(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantization_targets(
    model: nn.Module, include_head: bool = True, keep_float: tuple[str, ...] | None = None
) -> list[tuple[str, nn.Linear]]:
    """The float linear layers ``quantize_linears`` swaps: their kind is quantized and
    ``keep_float`` (default ``FLOAT_LINEARS``) does not name them."""
    names = QUANTIZED_LINEARS if include_head else QUANTIZED_LINEARS[:-1]
    patterns = FLOAT_LINEARS if keep_float is None else keep_float
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.rsplit(".", 1)[-1] in names
        and not keeps_float(name, patterns)
    ]


def quantize_linears(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    include_head: bool = True,
    keep_float: tuple[str, ...] | None = None,
    calibration_ids: list[int] | None = None,
    weight_only: bool | None = None,
) -> int:
    """Swap the model's linear layers for INT8 ones in place, except those ``keep_float``
    (default ``FLOAT_LINEARS``) names, smoothed (CPU W8A8) when calibration ids are given;
    returns how many were swapped. weight_only: see ``uses_weight_only``."""
    targets = quantization_targets(model, include_head, keep_float)
    weight_only = uses_weight_only(device, weight_only)
    maxima: dict[str, Tensor] = {}
    if not weight_only and SMOOTH_ALPHA is not None and calibration_ids:
        maxima = activation_maxima(model, calibration_ids, {name for name, _ in targets})
    for name, module in targets:
        replacement = int8_module(module, device, dtype, maxima.get(name), weight_only)
        model.set_submodule(name, replacement)
    return len(targets)
