"""--quantization int8 on plain tensors (issue 18): the CPU INT8 linear stays within a bounded
error of the float product per token, SmoothQuant-style smoothing keeps the product and tames
outlier channels, and bad option combinations refuse with one line. The same layers inside a
real engine are tests/engine/test_quant_engine.py and tests/engine/test_quant_smooth.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.services.engine.quant.int8_linear import CpuInt8Linear
from pdserve.services.engine.quant.int8_weights import int8_linear_reference, quantize_per_channel
from pdserve.services.engine.quant.options import quantization_problem
from pdserve.services.engine.quant.smooth import smoothing_scales


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_int8_linear_matches_reference_per_token(rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 80, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    w8 = quantize_per_channel(weight)
    layer = CpuInt8Linear(w8, bias, torch.float32)
    got = layer(x)
    ref = int8_linear_reference(x, w8, bias)
    exact = x @ weight.T + bias
    # fbgemm rounds activations asymmetrically (uint8); per token it is within one step of ours.
    # Without VNNI (an AVX2 CPU) it rounds them to 7 bits (reduce_range): a step twice as large.
    bound = 0.04 if layer.reduce_range else 0.02
    assert ((got - ref).norm(dim=1) / exact.norm(dim=1)).max() < bound
    assert ((got - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.03


def test_bad_combinations_refuse_with_one_line() -> None:
    cpu = torch.device("cpu")
    assert quantization_problem("int8", "int8", cpu, torch.float32) is None
    for args in (("int4", "auto"), ("none", "fp8")):
        problem = quantization_problem(*args, cpu, torch.float32)
        assert problem and "\n" not in problem


def _rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((got - exact).norm(dim=1) / exact.norm(dim=1)).max())


def test_smoothing_keeps_the_product_and_tames_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen) * 0.05
    x = torch.randn(16, 128, generator=gen)
    x[:, :3] *= 80.0  # a few outlier input channels, as in SmolLM2's activations
    exact = x @ weight.T
    plain = CpuInt8Linear(quantize_per_channel(weight), None, torch.float32)(x)
    s = smoothing_scales(x.abs().amax(dim=0), weight, 0.5)
    smoothed = CpuInt8Linear(quantize_per_channel(weight * s), None, torch.float32, s)(x)
    assert _rel_err(smoothed, exact) < 0.02
    assert _rel_err(smoothed, exact) < 0.5 * _rel_err(plain, exact)


def test_smoothing_scales_follow_the_formula() -> None:
    act = torch.tensor([4.0, 1.0, 100.0])
    weight = torch.tensor([[1.0, -0.25, 0.01], [0.5, 0.5, -0.04]])
    s = smoothing_scales(act, weight, 0.5)
    expected = act.sqrt() / torch.tensor([1.0, 0.5, 0.04]).sqrt()
    torch.testing.assert_close(s, expected)
