"""perf/quant_kernels_bench.py runs once on a lent GPU: its code paths are checked here first."""

from __future__ import annotations

import json

from perf import quant_kernels_bench


def test_smoke_run_checks_every_variant(tmp_path) -> None:
    out = tmp_path / "rows.json"
    assert quant_kernels_bench.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    impls = {(r["op"], r["impl"]) for r in rows}
    assert ("linear", "int8 group-32 (Q8_0)") in impls
    assert ("decode_attention", "int8 cache") in impls
    assert ("decode_attention", "fp8_e4m3 cache") in impls
    assert all(r["max_err"] is not None for r in rows if r["speedup_vs_bf16"] is not None)


def test_group_quantize_round_trips_within_half_a_step() -> None:
    import torch

    w = torch.randn(8, 64)
    q, scale = quant_kernels_bench.group_quantize(w, 32)
    back = q.float().view(8, 2, 32) * scale[..., None]
    assert (back.view(8, 64) - w).abs().le(scale.repeat_interleave(32, 1) / 2 + 1e-7).all()
