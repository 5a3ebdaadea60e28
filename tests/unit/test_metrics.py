"""pdserve.shared.telemetry.metrics served over real HTTP and read back with prometheus_client's own parser."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.telemetry import buckets as bucket_tables
from pdserve.shared.telemetry import metrics


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}; fails on anything that is not valid text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def buckets(samples: dict, name: str, **labels: str) -> list[tuple[float, float]]:
    rows = []
    for (sample_name, sample_labels), value in samples.items():
        lab = dict(sample_labels)
        if sample_name == f"{name}_bucket" and all(lab.get(k) == v for k, v in labels.items()):
            rows.append((float(lab["le"]), value))
    return sorted(rows)


def load(worker_id: str, role: str, free: int, total: int, running: int, waiting: int):
    return WorkerLoad(
        worker_id=worker_id,
        role=role,
        model="demo",
        free_blocks=free,
        total_blocks=total,
        running=running,
        waiting=waiting,
    )


async def scrape(registry: CollectorRegistry, accept: str | None = None) -> tuple[str, str]:
    app = web.Application()
    app.router.add_get("/metrics", metrics.metrics_handler(registry))
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/metrics", headers={"Accept": accept} if accept else None)
        assert resp.status == 200
        return await resp.text(), resp.headers["Content-Type"]


async def test_gateway_histograms_count_the_requests_made() -> None:
    registry = CollectorRegistry()
    m = metrics.GatewayMetrics(registry)
    requests = [  # (ttft, itls, finish reason, prompt tokens)
        (0.030, [0.004, 0.006, 0.005], "stop", 12),
        (0.300, [0.020], "length", 40),
        (2.000, [], "abort", 7),
    ]
    m.in_flight.inc(5)
    for ttft, itls, reason, prompt in requests:
        m.ttft.observe(ttft)
        for gap in itls:
            m.itl.observe(gap)
        m.request_finished(reason, prompt, 1 + len(itls), ttft + sum(itls))
        m.in_flight.dec()

    text, content_type = await scrape(registry)
    assert content_type.startswith("text/plain; version=0.0.4")  # Prometheus 3 needs the version
    s = parse(text)
    assert s[("pdserve_time_to_first_token_seconds_count", ())] == 3
    assert s[("pdserve_time_to_first_token_seconds_sum", ())] == pytest.approx(2.33)
    assert s[("pdserve_inter_token_latency_seconds_count", ())] == 4
    assert s[("pdserve_e2e_request_latency_seconds_count", ())] == 3
    ttft = dict(buckets(s, "pdserve_time_to_first_token_seconds"))
    bounds = (0.02, 0.04, 0.25, 0.5, 2.5, math.inf)
    assert [ttft[le] for le in bounds] == [0, 1, 1, 2, 3, 3]
    for reason in ("stop", "length", "abort"):
        assert s[("pdserve_requests_total", (("finish_reason", reason),))] == 1
    assert s[("pdserve_prompt_tokens_total", ())] == 59
    assert s[("pdserve_generation_tokens_total", ())] == 4 + 2 + 1
    assert s[("pdserve_request_generation_tokens_count", ())] == 3
    assert s[("pdserve_requests_in_flight", ())] == 2


async def test_gateway_reexports_live_worker_loads() -> None:
    registry = CollectorRegistry()
    metrics.GatewayMetrics(registry)
    live = {
        "p1": load("p1", "prefill", 900, 1000, 2, 5),
        "d1": load("d1", "decode", 10, 500, 31, 0),
    }
    registry.register(metrics.WorkerLoadCollector(lambda: list(live.values())))

    s = parse((await scrape(registry))[0])
    assert s[("pdserve_kv_cache_used_blocks", (("role", "prefill"), ("worker", "p1")))] == 100
    assert s[("pdserve_kv_cache_total_blocks", (("role", "prefill"), ("worker", "p1")))] == 1000
    assert s[("pdserve_kv_cache_used_blocks", (("role", "decode"), ("worker", "d1")))] == 490
    assert s[("pdserve_running_requests", (("role", "decode"), ("worker", "d1")))] == 31
    assert s[("pdserve_waiting_requests", (("role", "prefill"), ("worker", "p1")))] == 5

    # A worker that left the registry must vanish, not linger with its last values.
    del live["p1"]
    live["d1"] = load("d1", "decode", 500, 500, 0, 0)
    s = parse((await scrape(registry))[0])
    assert not [key for key in s if dict(key[1]).get("worker") == "p1"]
    assert s[("pdserve_kv_cache_used_blocks", (("role", "decode"), ("worker", "d1")))] == 0


async def test_openmetrics_when_the_scraper_asks_for_it() -> None:
    registry = CollectorRegistry()
    m = metrics.GatewayMetrics(registry)
    m.ttft.observe(0.05)
    m.request_finished("stop", 3, 4, 0.2)
    text, content_type = await scrape(registry, "application/openmetrics-text;version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_families(text)}
    [count] = [
        s
        for s in families["pdserve_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert count.value == 1
    [stop] = families["pdserve_requests"].samples[:1]
    assert (stop.name, stop.labels, stop.value) == (
        "pdserve_requests_total",
        {"finish_reason": "stop"},
        1,
    )


def test_load_collector_registers_before_discovery_runs() -> None:
    calls = []

    def loads():
        calls.append(1)
        return []

    registry = CollectorRegistry()
    registry.register(metrics.WorkerLoadCollector(loads))
    assert calls == []  # registration must not poll discovery


def test_worker_metrics_server_serves_its_registry() -> None:
    registry = CollectorRegistry()
    m = metrics.WorkerMetrics(registry, role="decode")
    m.queue_time.observe(0.003)
    m.prefill_time.observe(0.2)
    for _ in range(3):
        m.decode_step_time.observe(0.008)
    m.kv_transfer_seconds.observe(0.0021)
    m.kv_transfer_bytes.inc(3 << 20)
    m.preemptions.inc()
    m.prefix_cache_queries.inc(10)
    m.prefix_cache_hits.inc(6)
    m.set_load(used_blocks=120, total_blocks=512, running=7, waiting=2)

    server = metrics.start_metrics_server(0, registry, addr="127.0.0.1")
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    role = (("role", "decode"),)
    s = parse(text)
    assert s[("pdserve_worker_queue_time_seconds_count", role)] == 1
    assert s[("pdserve_worker_prefill_time_seconds_sum", role)] == pytest.approx(0.2)
    assert s[("pdserve_worker_decode_step_seconds_count", role)] == 3
    assert s[("pdserve_kv_transfer_seconds_count", role)] == 1
    assert s[("pdserve_kv_transfer_bytes_total", role)] == 3 << 20
    assert s[("pdserve_worker_preemptions_total", role)] == 1
    assert s[("pdserve_worker_prefix_cache_queries_total", role)] == 10
    assert s[("pdserve_worker_prefix_cache_hits_total", role)] == 6
    assert s[("pdserve_worker_kv_cache_used_blocks", role)] == 120
    assert s[("pdserve_worker_kv_cache_total_blocks", role)] == 512
    assert s[("pdserve_worker_running_requests", role)] == 7
    assert s[("pdserve_worker_waiting_requests", role)] == 2
    kv = dict(buckets(s, "pdserve_kv_transfer_seconds", role="decode"))
    assert (kv[0.001], kv[0.0025]) == (0, 1)

    with pytest.raises(urllib.error.URLError):  # closed means the port is released
        urllib.request.urlopen(url, timeout=2)


def test_each_process_registry_is_independent() -> None:
    # Tests (and `pdserve up` in one interpreter) build several of each; names must not clash.
    a, b = CollectorRegistry(), CollectorRegistry()
    metrics.GatewayMetrics(a).ttft.observe(1.0)
    metrics.GatewayMetrics(b)
    metrics.WorkerMetrics(a, "prefill")
    metrics.WorkerMetrics(b, "decode")
    assert a.get_sample_value("pdserve_time_to_first_token_seconds_count") == 1
    assert b.get_sample_value("pdserve_time_to_first_token_seconds_count") == 0


@pytest.mark.parametrize(
    "name,lowest,highest",
    [
        ("TTFT_BUCKETS", 0.01, 300),
        ("ITL_BUCKETS", 0.001, 5),
        ("E2E_BUCKETS", 0.1, 600),
        ("QUEUE_BUCKETS", 0.001, 60),
        ("KV_TRANSFER_BUCKETS", 0.0005, 5),
    ],
)
def test_buckets_span_llm_latencies(name: str, lowest: float, highest: float) -> None:
    bounds = getattr(bucket_tables, name)
    assert list(bounds) == sorted(set(bounds))
    assert bounds[0] <= lowest and bounds[-1] >= highest
