"""`pdserve bench` against a real aiohttp server that streams OpenAI SSE with known timings.

The server sleeps TTFT before the first chunk and ITL between chunks, so every latency the
client reports has a known floor, and token counts are known exactly. It runs in its own thread
and event loop so the bench runs exactly as from the command line (its own asyncio.run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from pdserve.cli import main as cli_main
from pdserve.services.control.bench.client import (
    ClientConfig,
    LoadConfig,
    RequestRecord,
    run_benchmark,
)
from pdserve.services.control.bench.datasets import BenchRequest

TTFT_S = 0.040
ITL_S = 0.008
MODEL = "fake-model"
FAIL_TOKEN = 7  # a prompt starting with this id gets HTTP 500
PAIR_TOKEN = 9  # a prompt starting with this id streams two tokens per chunk
CUT_TOKEN = 11  # a prompt starting with this id gets its stream cut after two tokens


def _chunk(text: str, finish: str | None, n_tokens: int) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    body = {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def make_app(
    ttft_s: float = TTFT_S, itl_s: float = ITL_S, api_key: str | None = None
) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        if api_key is not None and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return web.json_response({"error": {"message": "want token ids"}}, status=400)
        if body.get("ignore_eos") is not True or body.get("stream") is not True:
            return web.json_response({"error": {"message": "want stream, ignore_eos"}}, status=400)
        if prompt[0] == FAIL_TOKEN:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        n = int(body["max_tokens"])
        per_chunk = 2 if prompt[0] == PAIR_TOKEN else 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(ttft_s)
        sent = 0
        while sent < n:
            k = min(per_chunk, n - sent)
            sent += k
            await resp.write(_chunk("a" * k, "length" if sent == n else None, k))
            if prompt[0] == CUT_TOKEN and sent == 2:
                return resp  # ends the response without usage or [DONE]
            if sent < n:
                await asyncio.sleep(itl_s)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        usage_body = {"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(usage_body).encode() + b"\n\n")
        await resp.write(b": keep-alive comment\n\ndata: [DONE]\n\n")
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


@contextlib.contextmanager
def serve_in_thread(app: web.Application) -> Iterator[str]:
    """Serve `app` on a free loopback port from its own thread and event loop."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with serve_in_thread(make_app()) as url:
        yield url


def test_records_match_server_timings(server_url: str) -> None:
    reqs = [BenchRequest([100 + i] * (5 + i), 6) for i in range(6)]
    reqs.append(BenchRequest([FAIL_TOKEN, 1, 2], 4))
    reqs.append(BenchRequest([PAIR_TOKEN, 1, 2], 7))  # 4 chunks: 2+2+2+1 tokens
    reqs.append(BenchRequest([CUT_TOKEN, 1, 2], 5))
    cfg = ClientConfig(base_url=server_url, model=MODEL)
    run = asyncio.run(run_benchmark(reqs, cfg, LoadConfig(float("inf")), progress=False))

    assert len(run.records) == len(reqs)
    assert [r.index for r in run.records] == list(range(len(reqs)))
    failed = run.records[6]
    assert not failed.success and "HTTP 500" in failed.error and "injected" in failed.error
    for rec in run.records[:6]:
        assert rec.success, rec.error
        assert rec.usage_tokens == rec.chunk_tokens == rec.output_tokens == 6
        assert rec.finish_reason == "length"
        assert len(rec.itl) == 5
        assert rec.ttft >= TTFT_S * 0.95
        # single gaps jitter with scheduling; the server's sleeps bound the total from below
        assert rec.latency >= TTFT_S + 5 * ITL_S
        assert np.median(rec.itl) >= ITL_S * 0.5
        # E2E ends at the last token chunk: TTFT plus the gaps, not the usage chunk or [DONE]
        assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl), abs=1e-9)
    assert [r.prompt_len for r in run.records[:6]] == [5, 6, 7, 8, 9, 10]
    paired = run.records[7]
    assert paired.success and len(paired.itl) == 3
    assert paired.chunk_tokens == 4  # one text chunk counts one token without token ids...
    assert paired.output_tokens == 7  # ...so the usage chunk's count is the one used
    assert 0 < run.client_cpu_s  # process CPU time, measured for the saturation warning
    cut = run.records[8]
    assert not cut.success and "without [DONE] after 2 tokens" in cut.error
    # all sent at once: every request was on its way before the first one finished
    ok = [r for r in run.records if r.success]
    assert max(r.start_time for r in run.records) < min(r.start_time + r.latency for r in ok)


def test_max_concurrency_serializes(server_url: str) -> None:
    reqs = [BenchRequest([50, 51], 3) for _ in range(4)]
    cfg = ClientConfig(base_url=server_url, model=MODEL)
    run = asyncio.run(run_benchmark(reqs, cfg, LoadConfig(float("inf"), max_concurrency=1), False))
    one = TTFT_S + 2 * ITL_S
    assert run.duration >= 4 * one * 0.95
    starts = sorted(r.start_time for r in run.records)
    # each starts only after the previous one ended, and its clock starts when it is sent
    assert all(b - a >= one * 0.9 for a, b in zip(starts, starts[1:], strict=False))
    # a request's clock starts when it gets a slot, not when it arrived: the last one waited
    # behind three others, and that wait is not part of its TTFT
    last = max(run.records, key=lambda r: r.start_time)
    assert last.ttft < last.start_time


def test_cli_writes_consistent_outputs(server_url: str, tmp_path: Path) -> None:
    rc = cli_main(
        [
            "bench",
            "--base-url",
            server_url,
            "--dataset",
            "random",
            "--num-requests",
            "10",
            "--input-len",
            "16",
            "--output-len",
            "5",
            "--range-ratio",
            "0.5",
            "--request-rate",
            "200",
            "inf",
            "--goodput",
            "ttft:5000",
            "tpot:1",  # ITL floor is 8 ms, so nothing meets a 1 ms TPOT SLO
            "--result-dir",
            str(tmp_path),
            "--result-name",
            "fake",
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "fake.json").read_text())
    assert doc["config"]["model"] is None and doc["config"]["num_requests"] == 10
    assert [run["request_rate"] for run in doc["runs"]] == [200, "inf"]
    lines = (tmp_path / "fake.records.jsonl").read_text().splitlines()
    by_run = [[json.loads(x) for x in lines if json.loads(x)["run"] == i] for i in (0, 1)]
    for run, records in zip(doc["runs"], by_run, strict=True):
        m = run["metrics"]
        assert {r["series"] for r in records} == {"pdserve"}
        assert {r["request_rate"] for r in records} == {run["request_rate"]}
        assert len(records) == 10 and m["completed"] == 10 and m["failed"] == 0
        assert m["total_output_tokens"] == sum(r["output_tokens"] for r in records)
        assert all(r["output_tokens"] == r["expected_output_len"] for r in records)
        assert m["output_len_mismatches"] == 0
        ttfts = sorted(r["ttft"] * 1000 for r in records)
        # records keep microseconds: the percentile agrees to a microsecond
        assert m["ttft_ms"]["percentiles"]["p99"] == pytest.approx(
            np.percentile(ttfts, 99), abs=1e-3
        )
        assert run["vllm"]["p99_ttft_ms"] == m["ttft_ms"]["percentiles"]["p99"]
        assert m["ttft_ms"]["median"] >= TTFT_S * 1000 * 0.95
        assert all(r["latency"] >= TTFT_S + (r["output_tokens"] - 1) * ITL_S for r in records)
        assert m["tpot_ms"]["median"] >= ITL_S * 1000 * 0.5
        assert m["itl_ms"]["count"] == sum(len(r["itl"]) for r in records)
        assert m["request_throughput"] == pytest.approx(10 / m["duration_s"])
        # tpot SLO of 1 ms is impossible here, so no request is good
        assert m["good_requests"] == 0 and m["slo_attainment"] == 0.0
        assert m["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 1.0}
        assert 0 < m["client_cpu_fraction"]
    assert not math.isnan(doc["runs"][0]["metrics"]["duration_s"])
    md = (tmp_path / "fake.md").read_text()
    assert "| pdserve | 200 | 10/0 |" in md and "| pdserve | inf | 10/0 |" in md
    pngs = ("fake_latency_cdf.png", "fake_sweep.png", "fake_timeline.png", "fake_slo_scale.png")
    for png in pngs:
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
        assert f"]({png})" in md

    # a saved result loads back whole and re-renders elsewhere without touching its data
    from pdserve.services.control.bench.report import main as report_main
    from pdserve.services.control.bench.results import load_runs

    runs, _ = load_runs(tmp_path / "fake.json")
    assert [len(r.records) for r in runs] == [10, 10]
    assert runs[1].request_rate == math.inf
    assert runs[0].metrics.to_dict() == doc["runs"][0]["metrics"]
    assert runs[0].records[3].itl == pytest.approx(by_run[0][3]["itl"])
    before = (tmp_path / "fake.json").read_bytes()
    assert report_main([str(tmp_path / "fake.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "fake.json").read_bytes() == before
    again = (tmp_path / "again" / "fake.md").read_text()
    assert again == md
    assert (tmp_path / "again" / "fake_latency_cdf.png").stat().st_size > 10_000


def test_cli_fails_fast_on_bad_endpoint(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--num-requests", "2", "--result-dir", str(tmp_path), "--no-progress"]
    wrong_path = ["bench", "--base-url", server_url, "--endpoint", "/v1/nope", "--model", MODEL]
    assert cli_main([*wrong_path, *common]) == 2
    assert "warm-up request" in capsys.readouterr().err
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    assert cli_main(["bench", "--base-url", f"http://127.0.0.1:{port}", *common]) == 2
    assert "Cannot connect" in capsys.readouterr().err
    chat = ["bench", "--base-url", server_url, "--endpoint", "/v1/chat/completions", *common]
    assert cli_main(chat) == 2
    assert "use a completions endpoint" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_arrival_pacing_is_followed(server_url: str) -> None:
    reqs = [BenchRequest([60, 61], 1) for _ in range(5)]
    cfg = ClientConfig(base_url=server_url, model=MODEL)
    t0 = time.perf_counter()
    run = asyncio.run(run_benchmark(reqs, cfg, LoadConfig(10.0, seed=3), False))
    assert time.perf_counter() - t0 >= run.duration
    offsets = np.concatenate(
        [[0.0], np.cumsum(np.random.default_rng(3).gamma(1.0, 1 / 10.0, size=4))]
    )
    starts = np.array([r.start_time for r in run.records])
    assert np.all(starts >= offsets - 1e-3)
    # sends are due at absolute times, so lateness does not pile up along the run
    assert np.all(starts - offsets < 0.25)


def test_scenario_harness_compares_sides(tmp_path: Path) -> None:
    """The side-by-side harness on two running endpoints: one decodes 20x faster."""
    from perf import scenarios

    affinity = os.sched_getaffinity(0)
    with (
        serve_in_thread(make_app(0.02, 0.002)) as fast,
        serve_in_thread(make_app(0.02, 0.040)) as slow,
    ):
        rc = scenarios.main(
            [
                *("disagg-vs-agg", "--external", f"fast={fast}", "--external", f"slow={slow}"),
                *("--results", str(tmp_path), "--name", "cmp", "--"),
                *("--dataset", "random", "--num-requests", "6", "--input-len", "8"),
                *("--output-len", "6", "--long-fraction", "0", "--request-rate", "100", "inf"),
                *("--goodput", "ttft:2000", "tpot:150", "--no-progress"),
            ]
        )
    assert rc == 0
    assert os.sched_getaffinity(0) == affinity  # nothing started here, so no client pinning
    out = tmp_path / "cmp"
    doc = json.loads((out / "bench.json").read_text())
    # rates alternate between sides (ABBA), so both see the same machine conditions
    order = [(r["series"], r["request_rate"]) for r in doc["runs"]]
    assert order == [("fast", 100), ("slow", 100), ("slow", "inf"), ("fast", "inf")]
    records = [json.loads(x) for x in (out / "bench.records.jsonl").read_text().splitlines()]
    prompts: dict[object, list[int]] = {}
    for i, run in enumerate(doc["runs"]):
        lens = [r["prompt_len"] for r in records if r["run"] == i]
        prompts.setdefault(run["request_rate"], lens)
        assert len(lens) == 6 and prompts[run["request_rate"]] == lens  # same workload
    summary = json.loads((out / "comparison.json").read_text())
    assert (summary["candidate"], summary["baseline"]) == ("fast", "slow")
    for row in summary["per_rate"]:
        # ~2 ms against ~40 ms; scheduling noise on a busy machine only adds to the fast side
        assert 0.05 < row["tpot_p99_ratio"] < 0.5
        assert row["goodput_ratio"] > 0.5  # all good on both sides; req/s differ by duration
    assert summary["distserve_goodput_base"] == summary["distserve_goodput_cand"] == 100
    assert summary["tpot_target_met"] is True and summary["goodput_target_met"] is False
    md = (out / "comparison.md").read_text()
    assert "p99 TPOT ratio at inf req/s" in md and "(target <= 0.5x): met" in md
    assert "(target >= 1.5x): MISSED by 33%" in md
    for name in ("bench.md", "bench_latency_cdf.png", "bench_sweep.png"):
        assert (out / name).stat().st_size > 500


def test_scenario_skips_higher_rates_of_a_saturated_side(tmp_path: Path) -> None:
    from perf import scenarios

    with serve_in_thread(make_app(0.005, 0.010)) as slow:
        rc = scenarios.main(
            [
                *("token-overhead", "--external", f"slow={slow}"),
                *("--results", str(tmp_path), "--name", "sat", "--"),
                *("--num-requests", "3", "--output-len", "4", "--warmup-requests", "0"),
                *("--request-rate", "inf", "50", "--goodput", "tpot:2", "--no-progress"),
            ]
        )
    assert rc == 0
    doc = json.loads((tmp_path / "sat" / "bench.json").read_text())
    # rates run in ascending order; after 0% attainment at 50 req/s, inf is not tried, and
    # the goodput search halves the rate twice looking for one that passes
    runs = [(r["request_rate"], r["metrics"]["slo_attainment"]) for r in doc["runs"]]
    assert runs == [(50, 0), (25, 0), (12.5, 0)]


def test_api_key_is_sent_as_bearer() -> None:
    reqs = [BenchRequest([70, 71], 2)]
    with serve_in_thread(make_app(0.001, 0.001, api_key="s3cret")) as url:
        good = ClientConfig(base_url=url, model=MODEL, api_key="s3cret")
        bad = ClientConfig(base_url=url, model=MODEL, api_key="nope")
        ok = asyncio.run(run_benchmark(reqs, good, LoadConfig(), False)).records[0]
        refused = asyncio.run(run_benchmark(reqs, bad, LoadConfig(), False)).records[0]
    assert ok.success and ok.output_tokens == 2
    assert not refused.success and refused.error.startswith("HTTP 401")


def test_client_cores_avoid_the_services() -> None:
    from perf.scenarios import client_cores

    usable = sorted(os.sched_getaffinity(0))
    assert client_cores("none", [[1]], [0]) == []
    assert client_cores("3,5-6", [[1]], [0]) == [3, 5, 6]
    assert client_cores("auto", [[usable[-1]]], []) == usable[:-1]
    assert client_cores("auto", [[c] for c in usable], []) == []


def test_tpot_is_judged_where_the_baseline_still_copes() -> None:
    from perf.bench.compare import tpot_judging_row

    rows = [
        {"rate": 1.0, "base_attainment": 0.95, "tpot_p99_ratio": 0.7},
        {"rate": 2.0, "base_attainment": 0.6, "tpot_p99_ratio": 0.4},
        {"rate": 4.0, "base_attainment": 0.1, "tpot_p99_ratio": 1.1},  # both only queue here
    ]
    assert tpot_judging_row(rows)["rate"] == 2.0
    assert tpot_judging_row(rows[2:])["rate"] == 4.0  # nothing copes: the lowest rate


def test_goodput_knee_bisection() -> None:
    from perf.scenarios import next_refine_rate

    assert next_refine_rate([(1, 1.0), (2, 0.95), (4, 0.5), (8, 0.0)], 0.9) == 3.0
    assert next_refine_rate([(1, 1.0), (2, 0.95), (3, 0.92), (4, 0.5)], 0.9) == 3.5
    assert next_refine_rate([(4, 0.2)], 0.9) == 2.0  # nothing passes: look below
    assert next_refine_rate([(1, 1.0), (2, 0.95), (math.inf, 0.0)], 0.9) is None
    # a noisy dip below a passing rate does not pull the search down
    assert next_refine_rate([(1, 0.5), (2, 0.95), (4, 0.1)], 0.9) == 3.0


def test_scenario_plan_pins_each_worker_to_its_own_cores() -> None:
    from perf import scenarios
    from perf.bench import topology

    assert topology.parse_cpu_list("0,2-4") == [0, 2, 3, 4]
    slots = topology.allocate_worker_cores(first=1, per_worker=2, workers=2)
    assert slots == [[1, 2], [3, 4]]
    disagg, agg = scenarios.SCENARIOS["disagg-vs-agg"].sides
    plans = {
        side.name: topology.plan_side(side, slots, [0], 8100, 4222, None, "services")
        for side in (disagg, agg)
    }
    by_role = {name: [(p.role, p.cores) for p in plan] for name, plan in plans.items()}
    assert by_role[disagg.name] == [
        ("nats", [0]),
        ("prefill", [1, 2]),
        ("decode", [3, 4]),
        ("gateway", [0]),
    ]
    assert by_role[agg.name] == [
        ("nats", [0]),
        ("decode", [1, 2]),
        ("decode", [3, 4]),
        ("gateway", [0]),
    ]
    for plan in plans.values():
        workers = [p for p in plan if p.role in ("prefill", "decode")]
        # equal worker cores on both sides; one thread per pinned core
        assert sorted(c for w in workers for c in w.cores) == [1, 2, 3, 4]
        for w in workers:
            assert w.argv[:3] == ["taskset", "-c", ",".join(map(str, w.cores))]
            assert w.argv[-1] == w.role and w.env["OMP_NUM_THREADS"] == "2"
            assert w.options["nats_url"] == "nats://127.0.0.1:4222"
        assert len({w.options["metrics_port"] for w in workers}) == len(workers)
        assert len({w.options["worker_id"] for w in workers}) == len(workers)
        gateway = plan[-1]
        assert gateway.argv[:3] == ["taskset", "-c", "0"] and gateway.options["port"] == 8100
    up = topology.plan_side(disagg, slots, [0], 8100, 4222, None, "up")
    assert len(up) == 1 and up[0].argv[:3] == ["taskset", "-c", "0,1,2,3,4"]
    assert up[0].argv[-6:] == ["--prefill-workers", "1", "--decode-workers", "1", "--port", "8100"]
    assert "nats_url" not in up[0].options  # `up` must start its own NATS
    with pytest.raises(ValueError):
        topology.plan_side(agg, slots[:1], [0], 8100, 4222, None, "services")


def test_engine_step_scrape_and_overhead_report() -> None:
    """Worker counters come from real worker-style /metrics pages (shared.metrics)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from pdserve.services.control.bench.metrics import compute_metrics
    from pdserve.services.control.bench.results import RunResult
    from pdserve.shared.telemetry.metrics import WorkerMetrics
    from perf import scenarios
    from perf.bench import topology
    from perf.bench.compare import scenario_report

    def serve(role: str) -> tuple[WorkerMetrics, Any, Any, str]:
        registry = CollectorRegistry()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
        return WorkerMetrics(registry, role), server, thread, f"http://127.0.0.1:{port}/metrics"

    decode, d_server, d_thread, d_url = serve("decode")
    prefill, p_server, p_thread, p_url = serve("prefill")
    try:
        urls = [d_url, p_url, "http://127.0.0.1:1/metrics"]  # the last one is dead
        for _ in range(3):
            decode.decode_step_time.observe(0.010)  # before the run: must not count
        before = topology.scrape_engine(urls)
        assert (before.decode_step_seconds, before.decode_steps) == pytest.approx((0.030, 3))
        for _ in range(4):
            decode.decode_step_time.observe(0.002)
        for _ in range(2):
            prefill.prefill_time.observe(0.05)
        decode.prefill_time.observe(0.05)  # a local prefill is not a remote one
        steps = topology.EngineSteps.between(before, topology.scrape_engine(urls))
    finally:
        for server, thread in ((d_server, d_thread), (p_server, p_thread)):
            server.shutdown()
            thread.join(5)
    assert (steps.steps, steps.remote_prefills) == (4, 2)
    assert steps.mean_ms == pytest.approx(2.0)

    # one request, 5 tokens, 2.5 ms per token seen through HTTP -> 0.5 ms overhead per token
    rec = RequestRecord(0, 8, 5, success=True, ttft=0.01, itl=[0.0025] * 4)
    rec.latency, rec.usage_tokens = 0.02, 5
    run = RunResult("side", math.inf, 1.0, 1, compute_metrics([rec], 1.0), [rec])
    scenario = scenarios.SCENARIOS["token-overhead"]
    md, summary = scenario_report([run], scenario, 0.9, "", {"side @ inf": steps})
    assert summary["engine"]["side @ inf"]["overhead_ms"] == pytest.approx(0.5)
    assert summary["overhead_target_met"] is True
    assert "per-token overhead 0.500 ms at p50 (target <= 1.0 ms): met" in md
    steps.warning = "side @ inf: only 0 of 1 prompts were prefilled on prefill workers"
    md, _ = scenario_report([run], scenario, 0.9, "", {"side @ inf": steps})
    assert "WARNING: side @ inf: only 0 of 1 prompts" in md


def test_sides_refuse_unknown_pdserve_options():
    from perf.bench.topology import Side

    with pytest.raises(ValueError, match="unknown pdserve options"):
        Side("typo", options={"enable_prefix_cache": False})
    assert Side("ok", options={"prefix_cache": False}).options == {"prefix_cache": False}
