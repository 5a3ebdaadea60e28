"""The few-rows matmul forms (services/engine/few_rows.py): every form computes x @ W.T + b,
the packed one is offered only to verification-sized row counts, and a weight written in place
is never served from a stale packed copy."""

from __future__ import annotations

import pytest
import torch

from pdserve.services.engine import few_rows
from pdserve.services.engine.few_rows import FewRowsLinear, can_pack
from pdserve.services.engine.model import Linear


@pytest.fixture(autouse=True)
def fresh_timings(monkeypatch):
    monkeypatch.setattr(few_rows, "_FORM", {})


def layer(out_features: int = 96, in_features: int = 64, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    lin = Linear(in_features, out_features, bias=bias)
    lin.requires_grad_(False)
    return lin


@pytest.mark.parametrize("form", ["usual", "flipped", "packed"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 12])
def test_every_form_computes_the_linear(form: str, rows: int, monkeypatch) -> None:
    lin = layer()
    if form == "packed" and not can_pack(lin.weight):
        pytest.skip("this torch has no MKL packed GEMM")
    monkeypatch.setattr(few_rows, "_FORM", dict.fromkeys(few_rows.FEW_ROWS, form))
    x = torch.randn(rows, 64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-5, atol=1e-5)


def test_the_timing_picks_one_form_per_row_count_and_packs_only_verification_rows() -> None:
    lin = layer(bias=False)
    for rows in few_rows.FEW_ROWS:
        lin(torch.randn(rows, 64))
    assert set(few_rows._FORM) == set(few_rows.FEW_ROWS)
    assert all(form in {"usual", "flipped", "packed"} for form in few_rows._FORM.values())
    assert all(
        form != "packed" for rows, form in few_rows._FORM.items() if rows > few_rows.MAX_PACKED_ROWS
    )


def test_a_weight_written_in_place_is_packed_again(monkeypatch) -> None:
    lin = layer()
    if not can_pack(lin.weight):
        pytest.skip("this torch has no MKL packed GEMM")
    monkeypatch.setattr(few_rows, "_FORM", {4: "packed"})
    x = torch.randn(4, 64)
    lin(x)
    first = lin._few_rows
    lin.weight.mul_(2.0)  # as a loader or a test writing weights after a first call would
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-5, atol=1e-5)
    assert lin._few_rows is not first


def test_cuda_and_one_row_keep_the_module_path() -> None:
    lin = FewRowsLinear(torch.randn(8, 4), None)
    assert lin(torch.randn(1, 4)) is None
    assert lin(torch.randn(3, 2, 4)) is None


def test_a_weight_that_cannot_pack_takes_the_usual_form_where_packing_won() -> None:
    """The forms are timed on the first engine's float32 weights; a float64 engine in the same
    process (the HF-oracle tests) met "packed" and failed in MKL's reorder, when packing won the
    timing on a loaded machine."""
    few_rows._FORM.update(dict.fromkeys(few_rows.FEW_ROWS, "packed"))
    lin = layer().double()
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)
