"""The AVX2 few-row kernels (kernels/cpu_gemv.cpp, issue 42) against their references: INT8
rows rounded per token and summed exactly (``int8_linear_reference``, the CPU W8A8 math), and
bfloat16 weights against ``F.linear`` in float64; row counts on both sides of the kernel's
MAX_ROWS, widths with and without a tail, and the ops inside a compiled graph with a dynamic
batch (no recompile across row counts)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

from pdserve.kernels import cpu_gemv
from pdserve.services.engine.quant.int8_linear import CpuInt8Linear
from pdserve.services.engine.quant.int8_weights import int8_linear_reference, quantize_per_channel

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no AVX2 kernel on this CPU")


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [576, 80, 1539])
def test_int8_gemv_is_the_per_token_w8a8_product(rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * k)
    w8 = quantize_per_channel(torch.randn(96, k, generator=gen) * 0.05)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    got = cpu_gemv.int8_gemv(x, w8.qweight, w8.scale)
    ref = int8_linear_reference(x.double(), w8)
    # the same integers, then float32 scaling against float64
    assert _rel(got, ref) < 1e-6
    for r in range(rows):  # a row's result does not depend on the rows beside it
        alone = cpu_gemv.int8_gemv(x[r : r + 1].contiguous(), w8.qweight, w8.scale)
        torch.testing.assert_close(alone[0], got[r], rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_cpu_int8_linear_takes_the_kernel_for_few_rows_only(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(64, 96, generator=gen) * 0.05
    layer = CpuInt8Linear(quantize_per_channel(weight), None, torch.float32)
    x = torch.randn(rows, 96, generator=gen)
    got = layer(x)
    exact = x @ weight.T
    kernel = cpu_gemv.int8_gemv(x, layer.qweight, layer.scale)
    assert torch.equal(got, kernel) == (rows <= cpu_gemv.MAX_ROWS)
    assert _rel(got, exact) < 0.03


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9])
@pytest.mark.parametrize("k", [576, 83])
def test_bf16_gemv_matches_a_float64_product(rows: int, k: int) -> None:
    """Row groups up to 8 in one pass over the weight (9: a second pass of one row)."""
    gen = torch.Generator().manual_seed(rows + k)
    w = torch.randn(130, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen)
    got = cpu_gemv.bf16_gemv(x, w)
    assert _rel(got, x.double() @ w.double().T) < 1e-6
    for r in range(rows):  # a row's result does not depend on the rows beside it
        alone = cpu_gemv.bf16_gemv(x[r : r + 1].contiguous(), w)
        torch.testing.assert_close(alone[0], got[r], rtol=0, atol=0)
    xb = x.bfloat16()
    linear = cpu_gemv.bf16_linear(xb, w, None)
    assert linear.dtype == torch.bfloat16
    assert _rel(linear, F.linear(xb.float(), w.float())) < 1e-2
    # the kernel's own result up to MAX_BF16_ROWS rows, oneDNN's above
    if rows <= cpu_gemv.MAX_BF16_ROWS:
        assert torch.equal(linear, cpu_gemv.bf16_gemv(xb.float(), w).bfloat16())
    else:
        assert torch.equal(linear, F.linear(xb, w))


def test_ops_in_a_compiled_graph_serve_every_row_count_without_recompiling() -> None:
    gen = torch.Generator().manual_seed(0)
    w8 = quantize_per_channel(torch.randn(48, 64, generator=gen))
    layer = CpuInt8Linear(w8, None, torch.float32)
    wb = torch.randn(40, 48, generator=gen).bfloat16()

    def step(x: torch.Tensor) -> torch.Tensor:
        return cpu_gemv.bf16_linear(layer(x).bfloat16(), wb, None)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for rows in (2, 3, 4, 5, 8, 16):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(compiled(x), step(x), rtol=0, atol=0)
    assert counter.frame_count == 1


def _column_major(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 weight [N, K] laid out as model_setup.lay_out_for_gemv lays it: its transpose
    contiguous."""
    return torch.randn(n, k, generator=gen).t().contiguous().t()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 24])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (101, 37), (576, 1536), (300, 700)])
def test_f32_colmajor_gemv_matches_a_float64_product(rows: int, n: int, k: int) -> None:
    """Widths with a tail of columns (101, 300) and of weight rows past a block of 8 (37, 700),
    and row groups past 4 (interleaved, with a remainder of 1-3 rows)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    w = _column_major(n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    got = cpu_gemv.f32_linear_now(x, w, None)
    assert _rel(got, x.double() @ w.double().T) < 1e-6
    for r in range(rows):  # a row's sums run in one order whatever rows are beside it
        alone = cpu_gemv.f32_linear_now(x[r : r + 1].contiguous(), w, None)
        torch.testing.assert_close(alone[0], got[r], rtol=0, atol=0)


def test_column_major_float32_linears_take_the_kernel_for_1_to_24_rows() -> None:
    """In a model (model_setup.use_cpu_gemv), eagerly and inside a compiled graph of a dynamic
    batch: the kernel's own result for 1-24 rows, ``F.linear``'s otherwise, and no recompile."""
    from pdserve.services.engine.model import Linear
    from pdserve.services.engine.model_setup import lay_out_for_gemv, use_cpu_gemv

    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 80, bias=True)).requires_grad_(False)
    lay_out_for_gemv(model, torch.device("cpu"))
    use_cpu_gemv(model, torch.device("cpu"))
    layer = model[0]
    assert layer._f32_colmajor
    kernel = lambda x: cpu_gemv.f32_linear_now(x, layer.weight, layer.bias)  # noqa: E731
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    # one row last: Dynamo specialises a size of 1, as the engine's batch-1 graph is its own
    for rows in (2, 3, 4, 5, 9, 24, 25, 49, 1):
        x = torch.randn(rows, 64)
        eager = layer(x)
        if cpu_gemv.f32_rows(rows):
            assert torch.equal(eager, kernel(x))
        else:
            assert torch.equal(eager, F.linear(x, layer.weight, layer.bias))
        assert torch.equal(compiled(x), eager)
        assert counter.frame_count == (1 if rows > 1 else 2)
