"""Metric math, goodput, arrivals and dataset shapes of `pdserve bench`, on hand-made inputs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.services.control.bench import datasets as ds
from pdserve.services.control.bench.arrivals import arrival_offsets
from pdserve.services.control.bench.cli import make_parser
from pdserve.services.control.bench.client import RequestRecord
from pdserve.services.control.bench.metrics import (
    Distribution,
    compute_metrics,
    is_good,
    max_goodput_rate,
    parse_goodput,
    request_tpot,
)
from pdserve.services.control.bench.sweep import build_dataset


def rec(
    index: int,
    ttft: float,
    itl: list[float],
    tokens: int,
    prompt_len: int = 10,
    start: float = 0.0,
    usage: int | None = None,
) -> RequestRecord:
    r = RequestRecord(index, prompt_len, tokens, success=True, start_time=start, ttft=ttft)
    r.itl = list(itl)
    r.latency = ttft + sum(itl)
    r.chunk_tokens = len(itl) + 1
    r.usage_tokens = usage if usage is not None else tokens
    return r


def failed(index: int) -> RequestRecord:
    return RequestRecord(index, 10, 5, success=False, error="HTTP 500")


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        rec(0, 0.100, [0.010] * 4, 5, prompt_len=10, start=0.0),  # TPOT 10 ms
        rec(1, 0.200, [0.020] * 2, 3, prompt_len=20, start=0.5),  # TPOT 20 ms
        rec(2, 0.300, [], 1, prompt_len=30, start=1.0),  # one token: no TPOT, no ITL
        # two chunks of 3 tokens: TPOT = 0.050 / (6 - 1) = 10 ms, ITL pooled = one 50 ms gap
        rec(3, 0.400, [0.050], 6, prompt_len=40, start=1.5),
        failed(4),
    ]


def test_latency_metrics_follow_vllm_definitions(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0, percentiles=(50, 90, 99))
    assert (m.num_requests, m.completed, m.failed) == (5, 4, 1)
    assert m.total_input_tokens == 100  # the failed request's prompt is not counted
    assert m.total_output_tokens == 5 + 3 + 1 + 6
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(15 / 2.0)
    assert m.total_token_throughput == pytest.approx(115 / 2.0)
    # TTFT over successful requests: 100, 200, 300, 400 ms
    assert m.ttft_ms.count == 4
    assert m.ttft_ms.mean == pytest.approx(250.0)
    assert m.ttft_ms.median == pytest.approx(250.0)
    assert m.ttft_ms.p(90) == pytest.approx(370.0)  # linear: 300 + 0.7 * 100
    assert m.ttft_ms.p(99) == pytest.approx(397.0)
    assert m.ttft_ms.std == pytest.approx(np.std([100, 200, 300, 400]))
    # TPOT only for requests with more than one token: 10, 20, 10 ms
    assert m.tpot_ms.count == 3
    assert m.tpot_ms.mean == pytest.approx(40 / 3)
    assert m.tpot_ms.median == pytest.approx(10.0)
    # ITL pooled over all gaps: 4x10, 2x20, 1x50 ms
    assert m.itl_ms.count == 7
    assert m.itl_ms.mean == pytest.approx((40 + 40 + 50) / 7)
    assert m.itl_ms.median == pytest.approx(10.0)
    assert m.itl_ms.p(99) == pytest.approx(20 + 0.94 * 30)
    # E2E = TTFT + gaps: 140, 240, 300, 450 ms
    assert m.e2el_ms.mean == pytest.approx((140 + 240 + 300 + 450) / 4)
    assert m.output_len_mismatches == 0
    assert m.goodput_slos_ms == {} and m.request_goodput == 0.0 and m.slo_attainment == 0.0


def test_vllm_key_names(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, 2.0, {"ttft": 350.0}, percentiles=(50, 99, 99.9))
    flat = m.vllm_flat()
    assert flat["completed"] == 4 and flat["failed"] == 1 and flat["duration"] == 2.0
    assert flat["mean_ttft_ms"] == pytest.approx(250.0)
    assert flat["p99_ttft_ms"] == pytest.approx(397.0)
    assert "p99.9_itl_ms" in flat and "p50_e2el_ms" in flat and "std_tpot_ms" in flat
    assert flat["request_goodput"] == pytest.approx(m.good_requests / 2.0)
    assert compute_metrics(records, 2.0).vllm_flat()["request_goodput"] is None


def test_usage_count_beats_chunk_count() -> None:
    r = rec(0, 0.1, [0.02, 0.02], tokens=5, usage=5)  # 3 chunks carried 5 tokens
    assert r.chunk_tokens == 3 and r.output_tokens == 5
    assert request_tpot(r) == pytest.approx(0.04 / 4)
    r.usage_tokens = None  # a server without usage: fall back to counting chunks
    assert r.output_tokens == 3
    assert request_tpot(r) == pytest.approx(0.04 / 2)
    m = compute_metrics([r], 1.0)
    assert m.output_len_mismatches == 1  # asked for 5, saw 3


def test_goodput_counts_requests_meeting_every_slo(records: list[RequestRecord]) -> None:
    slos = parse_goodput(["ttft:350", "tpot:10.5"])
    assert slos == {"ttft": 350.0, "tpot": 10.5}
    good = [is_good(r, slos) for r in records]
    # 0: ttft 100, tpot 10 -> good; 1: tpot 20 -> bad;
    # 2: ttft 300, a single token has TPOT 0 -> good; 3: ttft 400 -> bad; 4: failed -> bad
    assert good == [True, False, True, False, False]
    m = compute_metrics(records, duration_s=4.0, goodput_slos_ms=slos)
    assert m.good_requests == 2
    assert m.request_goodput == pytest.approx(0.5)
    assert m.slo_attainment == pytest.approx(2 / 5)  # failures count against attainment
    e2e = compute_metrics(records, 4.0, parse_goodput(["e2el:300"]))
    assert e2e.good_requests == 3  # 140, 240, 300 ms: a value exactly at the SLO is good
    at_limit = rec(0, 0.25, [0.125, 0.125], 3)  # binary-exact: TTFT 250 ms, TPOT 125 ms
    assert is_good(at_limit, {"ttft": 250.0, "tpot": 125.0})
    assert not is_good(at_limit, {"ttft": 250.0, "tpot": 124.9})


def test_parse_goodput_rejects_bad_input() -> None:
    assert parse_goodput(["ttft:1.5,tpot:2"]) == {"ttft": 1.5, "tpot": 2.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:nan"], ["tpot:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_distribution_is_zero_not_nan() -> None:
    d = Distribution.of([], (50, 99))
    assert (d.count, d.mean, d.median, d.percentiles) == (0, 0.0, 0.0, {"p50": 0.0, "p99": 0.0})
    m = compute_metrics([failed(0), failed(1)], 1.0, {"ttft": 100})
    assert m.completed == 0 and m.ttft_ms.mean == 0.0 and m.slo_attainment == 0.0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_peak_tokens_and_concurrency_per_second() -> None:
    a = rec(0, 0.15, [0.1] * 9, 10, start=0.0)  # chunks at 0.15 .. 1.05 s: 9 in second 0
    b = rec(1, 0.05, [0.05] * 3, 4, start=0.2)  # chunks at 0.25 .. 0.4 s: all in second 0
    c = rec(2, 0.1, [], 1, start=2.5)  # alone in second 2
    m = compute_metrics([a, b, c], 3.0)
    assert m.max_output_tokens_per_s == 13
    assert m.max_concurrent_requests == 2


def test_max_goodput_rate_is_highest_rate_meeting_target() -> None:
    points = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.89), (3.0, 0.9), (math.inf, 0.99)]
    assert max_goodput_rate(points, 0.9) == 3.0  # inf is not a rate anyone can provision
    assert max_goodput_rate(points, 0.99) == 1.0
    assert max_goodput_rate([(1.0, 0.5)], 0.9) is None


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_requested_rate_and_spread(burstiness: float) -> None:
    offsets = arrival_offsets(20_000, 8.0, burstiness, np.random.default_rng(0))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    # gamma with shape k has coefficient of variation 1/sqrt(k): Poisson 1, bursty > 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_arrivals_are_reproducible_and_inf_means_at_once() -> None:
    a = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(42))
    b = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(42))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, arrival_offsets(50, 3.0, 1.0, np.random.default_rng(43)))
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))
    assert arrival_offsets(0, 1.0, 1.0, np.random.default_rng(0)).size == 0
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, np.random.default_rng(0))


TOKENS = ds.TokenSpace(32, 127)


def test_random_dataset_lengths() -> None:
    rng = np.random.default_rng(0)
    exact = ds.random_dataset(20, 64, 16, 0.0, TOKENS, rng)
    assert all(r.prompt_len == 64 and r.output_len == 16 for r in exact)
    spread = ds.random_dataset(2000, 100, 40, 0.5, TOKENS, rng)
    ins = np.array([r.prompt_len for r in spread])
    outs = np.array([r.output_len for r in spread])
    assert ins.min() >= 50 and ins.max() <= 150 and ins.mean() == pytest.approx(100, rel=0.03)
    assert outs.min() >= 20 and outs.max() <= 60
    assert ins.min() < 55 and ins.max() > 145  # the whole range is used
    ids = np.concatenate([r.prompt_token_ids for r in spread[:50]])
    assert ids.min() >= 32 and ids.max() < 127


def test_chat_dataset_is_heavy_tailed_and_clipped() -> None:
    reqs = ds.chat_dataset(4000, 200, 100, TOKENS, np.random.default_rng(1), 1.0, 0.7, 2000, 400)
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert np.median(ins) == pytest.approx(200, rel=0.08)
    assert np.median(outs) == pytest.approx(100, rel=0.08)
    assert ins.mean() > 1.3 * np.median(ins)  # long right tail
    assert ins.max() <= 2000 and outs.max() <= 400 and ins.min() >= 1 and outs.min() >= 1
    assert (ins == 2000).any()  # the clip is reached


def test_shared_prefix_dataset_groups_share_exact_prefix() -> None:
    reqs = ds.shared_prefix_dataset(12, 3, 64, 8, 5, 0.0, TOKENS, np.random.default_rng(2))
    assert all(r.prompt_len == 72 and r.output_len == 5 for r in reqs)
    prefix = [r.prompt_token_ids[:64] for r in reqs]
    for i, p in enumerate(prefix):
        assert p == prefix[i % 3]
    assert prefix[0] != prefix[1] != prefix[2]
    assert len({tuple(r.prompt_token_ids[64:]) for r in reqs}) == 12  # questions all differ


def test_long_prompts_replace_the_requested_fraction() -> None:
    rng = np.random.default_rng(3)
    base = ds.random_dataset(50, 32, 8, 0.0, TOKENS, rng)
    mixed = ds.with_long_prompts(base, 0.2, (2048, 4096), TOKENS, rng)
    long = [r for r in mixed if r.prompt_len > 32]
    assert len(long) == 10
    assert all(2048 <= r.prompt_len <= 4096 for r in long)
    assert [r.output_len for r in mixed] == [r.output_len for r in base]
    with pytest.raises(ValueError):
        ds.with_long_prompts(base, 1.5, (1, 2), TOKENS, rng)


def test_token_space_skips_special_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(20)}, unk_token="w0"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    space = ds.token_space_from_tokenizer(tmp_path)
    assert (space.low, space.high, space.excluded) == (0, 22, frozenset({20, 21}))
    ids = space.sample(np.random.default_rng(0), 5000)
    assert set(ids) == set(range(20))
    with pytest.raises(ValueError):
        ds.TokenSpace(20, 22, frozenset({20, 21}))  # nothing left to draw


def test_cli_options_build_the_scenario_mix() -> None:
    ns = make_parser().parse_args(
        "--dataset chat --num-requests 40 --input-len 128 --output-len 32 "
        "--long-fraction 0.25 --long-input-range 300:400 --seed 5".split()
    )
    reqs = build_dataset(ns)
    assert len(reqs) == 40
    assert sum(300 <= r.prompt_len <= 400 for r in reqs) >= 10
    assert [r.prompt_token_ids for r in build_dataset(ns)] == [r.prompt_token_ids for r in reqs]
    for bad in (
        ["--request-rate", "0"],
        ["--num-requests", "0"],
        ["--range-ratio", "1"],
        ["--long-fraction", "1.5"],
        ["--long-input-range", "9:3"],
        ["--percentiles", "50,101"],
    ):
        with pytest.raises(SystemExit):
            make_parser().parse_args(bad)


def test_cli_module_stays_light() -> None:
    """`pdserve` imports pdserve.services.control.bench.cli to build its parser; heavy imports wait for `run`."""
    import subprocess
    import sys

    code = (
        "import sys, pdserve.services.control.bench.cli; "
        "print(sorted(m for m in ('numpy', 'aiohttp', 'matplotlib', 'tqdm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_activity_timeline_conserves_tokens() -> None:
    from pdserve.services.control.bench.report import _activity
    from pdserve.services.control.bench.results import RunResult

    a = rec(0, 0.2, [0.5, 0.5], 6, start=0.0, usage=6)  # 3 chunks at 0.2, 0.7, 1.2 s: 2 each
    b = rec(1, 0.1, [], 1, start=1.5)  # one chunk at 1.6 s
    run = RunResult("s", 1.0, 1.0, None, compute_metrics([a, b, failed(2)], 2.0), [a, b, failed(2)])
    t, tokens_per_s, inflight = _activity(run, bin_s=0.5)
    assert t.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert tokens_per_s.tolist() == [4.0, 4.0, 4.0, 2.0, 0.0]  # 2 tokens in a 0.5 s bin = 4/s
    assert tokens_per_s.sum() * 0.5 == 7  # every output token lands in some bin
    assert inflight.tolist() == [1, 1, 1, 1, 0]  # a: 0..1.2 s, b: 1.5..1.6 s


def test_attainment_at_slo_scales(records: list[RequestRecord]) -> None:
    from pdserve.services.control.bench.report import attainment_at_scales
    from pdserve.services.control.bench.results import RunResult

    run = RunResult("s", 1.0, 1.0, None, compute_metrics(records, 2.0), records)
    # TTFTs 100..400 ms plus one failure; SLO 200 ms scaled by 0.5, 1, 2
    assert attainment_at_scales(run, {"ttft": 200.0}, [0.5, 1.0, 2.0]) == [0.2, 0.4, 0.8]
