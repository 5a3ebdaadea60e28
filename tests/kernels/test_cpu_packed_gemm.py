"""Float32 linears of 5 rows and more through oneDNN on a packed copy of the weight
(kernels/cpu_packed_gemm.cpp, issue 42): the product, eagerly and inside a compiled graph of a
dynamic batch, the few-row kernel still below 5 rows, and a copy that stops answering once its
weight is freed (its address may then hold another weight)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

from pdserve.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available() or not torch.backends.mkldnn.is_available(),
    reason="no AVX2 kernel or no oneDNN here",
)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _packed_layer(n: int, k: int):
    from pdserve.services.engine.model import Linear
    from pdserve.services.engine.model_setup import lay_out_for_gemv, pack_for_gemm, use_cpu_gemv

    model = torch.nn.Sequential(Linear(k, n, bias=True)).requires_grad_(False)
    lay_out_for_gemv(model, torch.device("cpu"))
    use_cpu_gemv(model, torch.device("cpu"))
    assert pack_for_gemm(model) == n * k * 4
    return model, model[0]


def test_many_rows_take_the_packed_copy_eagerly_and_compiled() -> None:
    torch.manual_seed(0)
    _, layer = _packed_layer(96, 64)
    assert layer._packed_gemm is not None
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for rows in (2, 4, 5, 24, 25, 64, 130, 3):
        x = torch.randn(rows, 64)
        eager = layer(x)
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        assert _rel(eager, exact) < 1e-6
        if rows < cpu_gemv.PACKED_FROM_ROWS:  # the few-row kernel
            assert cpu_gemv.f32_rows(rows, packed=True)
            assert torch.equal(eager, cpu_gemv.f32_linear_now(x, layer.weight, layer.bias))
        else:  # oneDNN's product on the copy: not MKL's F.linear on the weight
            packed = torch.ops.mkldnn._linear_pointwise(
                x, layer._packed_gemm, layer.bias, "none", [], ""
            )
            assert torch.equal(eager, packed)
        assert torch.equal(compiled(x), eager)
    assert counter.frame_count == 1


def test_a_freed_weight_s_copy_no_longer_answers() -> None:
    torch.manual_seed(1)
    gc.collect()  # earlier tests' engines: their weights' copies drop out once collected
    before = cpu_gemv.packed_gemm_count()
    model, layer = _packed_layer(128, 96)
    assert cpu_gemv.packed_gemm_count() == before + 1
    address = layer.weight.data_ptr()
    del model, layer
    gc.collect()
    assert cpu_gemv.packed_gemm_count() == before
    # a new weight of the same shape, perhaps at the same address, has no copy: F.linear's
    for _ in range(4):
        w = torch.randn(96, 128).t().contiguous().t()
        x = torch.randn(40, 128)
        assert torch.equal(cpu_gemv.f32_linear(x, w, None), F.linear(x, w))
        if w.data_ptr() == address:
            break


def test_packing_is_an_engine_option() -> None:
    from pdserve.shared.config import EngineConfig

    assert EngineConfig().cpu_packed_gemm
    assert not EngineConfig(cpu_packed_gemm=False).cpu_packed_gemm
