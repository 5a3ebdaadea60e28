"""The INT8 weight-only linear, per-channel and group-wise (GGUF Q8_0's layout: one float16 scale
per 32 input channels of a row): the Triton kernel against the plain-torch twin, and the twin
against the float matmul of the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels.reference_quant import int8_linear
from pdserve.services.engine.quant.int8_weights import (
    Int8Weight,
    quantize_groupwise,
    quantize_per_channel,
)
from tests.kernels.helpers import TEST_DEVICE, TEST_DTYPE


def q8_0_like(n: int, k: int, group: int, gen: torch.Generator) -> Int8Weight:
    """Random int8 values and float16 scales that differ a lot between a row's groups (so a
    scale applied to the wrong group, or once per row, shows)."""
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * torch.logspace(-4, -2, k // group)
    return Int8Weight(qweight, scale.to(torch.float16))


TOL = 2e-5 if TEST_DTYPE == torch.float32 else 3e-2


def triton_and_twin(kernel_backend, x, w: Int8Weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(the Triton kernel's output, the float64 twin's) for x @ w.T + bias."""
    qweight, scale = w.qweight.to(TEST_DEVICE), w.scale.to(TEST_DEVICE)
    kernel_backend("triton")
    got = ops.int8_linear(x, qweight, scale, bias)
    bias64 = None if bias is None else bias.double().cpu()
    expected = int8_linear(x.double().cpu(), qweight.cpu(), scale.double().cpu(), bias64)
    return got.double().cpu(), expected


@pytest.mark.parametrize("shape", [(1, 64, 96), (5, 200, 33), (40, 130, 257)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_triton_matches_twin(kernel_backend, shape, with_bias) -> None:
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=gen).to(TEST_DEVICE, TEST_DTYPE)
    w = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen).to(TEST_DEVICE, TEST_DTYPE) if with_bias else None
    got, expected = triton_and_twin(kernel_backend, x, w, bias)
    torch.testing.assert_close(got, expected, atol=TOL * 10, rtol=TOL)


@pytest.mark.parametrize("shape", [(1, 64, 96), (5, 224, 33), (40, 128, 257), (17, 256, 64)])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_int8_linear_triton_matches_twin(kernel_backend, shape, group, with_bias) -> None:
    m, k, n = shape
    if k % group:
        pytest.skip("K is not a whole number of groups")
    gen = torch.Generator().manual_seed(m * k + n + group)
    x = torch.randn(m, k, generator=gen).to(TEST_DEVICE, TEST_DTYPE)
    w = q8_0_like(n, k, group, gen)
    bias = torch.randn(n, generator=gen).to(TEST_DEVICE, TEST_DTYPE) if with_bias else None
    got, expected = triton_and_twin(kernel_backend, x, w, bias)
    scale_of_y = expected.abs().max()
    torch.testing.assert_close(got, expected, atol=TOL * scale_of_y, rtol=TOL)
    if k == group:
        return  # one group per row: per-channel
    # the per-row mean of the group scales is not the answer: each group's scale counts (it
    # misses by over ten times what the kernel is allowed, in bf16 on a GPU too)
    bias64 = None if bias is None else bias.double().cpu()
    per_row = w.scale.double().mean(dim=1)
    wrong = int8_linear(x.double().cpu(), w.qweight, per_row, bias64)
    assert (wrong - expected).abs().max() > 10 * TOL * scale_of_y


def test_grouped_twin_is_the_dequantized_matmul(kernel_backend) -> None:
    gen = torch.Generator().manual_seed(3)
    w = q8_0_like(48, 160, 32, gen)
    x = torch.randn(7, 160, generator=gen, dtype=torch.float64)
    kernel_backend("torch")
    got = ops.int8_linear(x, w.qweight, w.scale)
    torch.testing.assert_close(got, x @ w.dequantize(torch.float64).T, atol=1e-12, rtol=1e-12)
    # dequantize is exact: every weight is an int8 times its group's float16 scale
    dense = w.qweight.double().view(48, 5, 32) * w.scale.double()[..., None]
    assert torch.equal(w.dequantize(torch.float64), dense.view(48, 160))


def test_per_channel_is_unchanged_and_groups_must_be_powers_of_two(kernel_backend) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 96, generator=gen) * 0.05
    grouped = quantize_groupwise(weight, 96)  # one group per row is per-channel INT8
    x = torch.randn(3, 96, generator=gen).to(TEST_DEVICE, TEST_DTYPE)
    kernel_backend("triton")
    q = grouped.qweight.to(TEST_DEVICE)
    by_row = ops.int8_linear(x, q, grouped.scale[:, 0].contiguous().to(TEST_DEVICE))
    twin = int8_linear(x.double().cpu(), grouped.qweight, grouped.scale[:, 0].double())
    tol = 2e-5 if TEST_DTYPE == torch.float32 else 3e-2
    torch.testing.assert_close(by_row.double().cpu(), twin, atol=tol * 10, rtol=tol)
    with pytest.raises(ValueError, match="power of two"):
        ops.int8_linear(x, q, grouped.scale.expand(40, 4).contiguous().to(TEST_DEVICE))
