"""The planner's inputs and arithmetic against hand-computed numbers: the profile's interpolation
and JSON, a workload read from a real `pdserve bench` records file, and the prefill and decode
sizing formulas (sizing.py's docstring has them)."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest

from pdserve.services.control.bench.client import RequestRecord
from pdserve.services.control.bench.metrics import compute_metrics
from pdserve.services.control.bench.results import RunResult, record_lines
from pdserve.services.control.planner.profile import Profile, interp
from pdserve.services.control.planner.sizing import (
    erlang_c,
    size_decode,
    size_prefill,
    ttft_quantile,
)
from pdserve.services.control.planner.workload import SLO, Workload
from tests.unit.planner_support import hand_profile


def test_interpolation_is_linear_between_points_and_clamped_outside() -> None:
    xs, ys = [100, 200, 400], [10.0, 20.0, 10.0]
    assert interp(xs, ys, 150) == 15.0
    assert interp(xs, ys, 300) == 15.0
    assert interp(xs, ys, 50) == 10.0  # clamped, not extrapolated to 5
    assert interp(xs, ys, 1000) == 10.0
    p = Profile.from_points(
        [(100, 1000.0), (300, 3000.0)],
        [(1, 100, 10.0), (1, 300, 20.0), (3, 100, 30.0), (3, 300, 60.0)],
        kv_capacity_tokens=1000,
    )
    assert p.prefill_throughput(200) == 2000.0
    assert p.decode_itl(2, 200) == pytest.approx((15.0 + 45.0) / 2)  # bilinear
    assert p.decode_itl(9, 9999) == 60.0
    assert p.max_batch == 3
    assert not p.covers(50, 200) and p.covers(100, 300)


def test_profile_round_trips_through_json_and_refuses_a_hole(tmp_path: Path) -> None:
    p = Profile.synthetic()
    p.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json") == p
    assert "illustrative" in p.note
    batching = dataclasses.replace(p, prefill_batch_tokens=2048)
    assert Profile.from_dict(batching.to_dict()).prefill_batch_tokens == 2048
    old = p.to_dict()
    del old["prefill"]["batch_tokens"]  # a profile from before the field: one prompt a step
    assert Profile.from_dict(old).prefill_batch_tokens == 0
    with pytest.raises(ValueError, match="lacks"):
        Profile.from_points([(10, 1.0)], [(1, 10, 5.0), (2, 20, 6.0)], kv_capacity_tokens=10)
    with pytest.raises(ValueError, match="version"):
        Profile.from_dict({**p.to_dict(), "version": 99})


def test_a_scaled_profile_is_the_same_engine_that_much_slower() -> None:
    prof = hand_profile()
    slow = prof.scaled(prefill=2.0, decode=1.5)
    for n in (100, 700, 5000):
        assert slow.prefill_seconds(n) == pytest.approx(2.0 * prof.prefill_seconds(n))
    for batch, context in ((1, 100), (3, 900), (8, 4000)):
        assert slow.decode_itl(batch, context) == pytest.approx(
            1.5 * prof.decode_itl(batch, context)
        )
    assert slow.kv_capacity_tokens == prof.kv_capacity_tokens
    assert prof.scaled() == prof
    with pytest.raises(ValueError):
        prof.scaled(prefill=0.0)


def test_best_decode_batch_meets_the_itl_and_fits_the_kv() -> None:
    p = hand_profile()
    cap = p.best_decode(30.0, 1000)  # 10 + 0.5 (b - 1) <= 30  ->  b = 41, ITL 30 ms
    assert (cap.batch, cap.itl_ms, cap.limited_by) == (41, 30.0, "itl")
    assert cap.tokens_per_s == pytest.approx(41 / 0.030)
    small = hand_profile(kv_capacity=20_000)
    cap = small.best_decode(30.0, 1000, kv_fraction=0.8)  # 16,000 tokens / 1,000 per sequence
    assert (cap.batch, cap.itl_ms, cap.limited_by) == (16, 17.5, "kv")
    assert p.best_decode(5.0, 1000).limited_by == "unreachable"
    assert p.best_decode(100.0, 1000).limited_by == "max_batch"


def test_erlang_c_and_the_ttft_quantile_by_hand() -> None:
    assert erlang_c(1, 0.3) == pytest.approx(0.3)  # M/M/1: an arrival waits with prob. rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # one worker at 0.2 Erlangs, S = 0.1 s, p99, cv2 = 1: 0.1 + ln(0.2 / 0.01) / 8
    assert ttft_quantile(0.1, 0.2, 1, 0.99) == pytest.approx(0.1 + math.log(20) / 8)
    assert ttft_quantile(0.1, 0.2, 1, 0.50) == 0.1  # most requests never wait
    assert ttft_quantile(0.1, 1.0, 1, 0.99) == math.inf


def test_prefill_sizing_by_hand() -> None:
    p, slo = hand_profile(), SLO(ttft_ms=1000, itl_ms=30, percentile="p99")
    low = size_prefill(p, rate=2, isl=1000, slo=slo)  # 2 x 1000 / 10,000 = 0.2 busy workers
    assert low.offered == pytest.approx(0.2) and low.workers == 1
    # Dynamo's bare formula: ceil(9 x 1000 / 10,000) = 1 worker at 90% utilization, where the
    # p99 TTFT is 0.1 + ln(90) / 1 = 4.6 s. Two workers: C = 0.2793, TTFT = 0.1 + ln(27.93) / 11
    high = size_prefill(p, rate=9, isl=1000, slo=slo)
    assert high.offered == pytest.approx(0.9) and high.workers == 2
    assert ttft_quantile(0.1, 0.9, 2, 0.99) == pytest.approx(0.1 + math.log(27.931) / 11, abs=1e-3)
    assert 1 < high.need <= 2 and "-> 2" in high.explain()
    # a prefill faster than profiled (c = 0.5) halves the load; a slower one changes nothing
    assert size_prefill(p, 9, 1000, slo, correction=0.5).offered == pytest.approx(0.45)
    assert size_prefill(p, 9, 1000, slo, correction=3.0).offered == pytest.approx(0.9)
    assert size_prefill(p, 0, 1000, slo).workers == 0
    unreachable = size_prefill(p, 1, 1000, SLO(ttft_ms=50, itl_ms=30))  # a prompt takes 100 ms
    assert unreachable.at_risk and "at risk" in unreachable.explain()


def test_decode_sizing_by_hand() -> None:
    p, slo = hand_profile(), SLO(ttft_ms=1000, itl_ms=30)
    d = size_decode(p, rate=10, isl=900, osl=200, slo=slo)  # 2,000 tok/s / (41 / 0.030)
    assert d.need == pytest.approx(2000 / (41 / 0.030)) and d.workers == 2
    assert d.context == 1000
    # a decode 1.5x slower than profiled: target 20 ms -> batch 21 -> 1,050 tok/s per worker
    slow = size_decode(p, rate=12, isl=900, osl=200, slo=slo, correction=1.5)
    assert slow.capacity.batch == 21 and slow.need == pytest.approx(2400 / 1050)
    assert slow.workers == 3
    per_worker = 41 / 0.030
    exact = size_decode(p, rate=10, isl=900, osl=2 * per_worker / 10, slo=slo)
    assert exact.need == pytest.approx(2.0) and exact.workers == 2  # float noise is not a worker


def test_slo_and_workload_basics() -> None:
    assert SLO(100, 10, "p50").quantile == 0.5 and SLO(100, 10).quantile == 0.99
    with pytest.raises(ValueError):
        SLO(100, 10, "p42")
    w = Workload.from_samples(4.0, [(100, 10), (300, 30)])
    assert (w.isl, w.osl, w.decode_context) == (200, 20, 210)
    assert w.lengths(random.Random(0)) in w.samples
    assert Workload(1.0, 99.6, 10.2).lengths(random.Random(0)) == (100, 10)


def test_workload_from_a_bench_records_file(tmp_path: Path) -> None:
    """Written by the bench's own writer, so a format change there breaks this test."""
    records = []
    for i in range(5):
        r = RequestRecord(i, 100 * (i + 1), 64, success=True, start_time=0.5 * i, ttft=0.1)
        r.itl, r.latency, r.chunk_tokens, r.usage_tokens = [0.01] * 9, 0.2, 10, 10 + i
        records.append(r)
    records.append(RequestRecord(5, 9999, 64, success=False, start_time=2.5, error="boom"))
    run = RunResult("pdserve", 2.0, 1.0, None, compute_metrics(records, 3.0), records)
    path = tmp_path / "bench.records.jsonl"
    path.write_text("\n".join(record_lines([run])) + "\n")
    w = Workload.from_bench_records(tmp_path / "bench.json")  # finds the JSONL beside it
    assert w.samples == ((100, 10), (200, 11), (300, 12), (400, 13), (500, 14))  # failed: out
    assert w.request_rate == pytest.approx(4 / 2.0)  # 5 starts over 2 s
    assert (w.isl, w.osl) == (300, 12)
    assert Workload.from_bench_records(path, request_rate=7.0).request_rate == 7.0
