"""One request through a real 1P1D stack leaves one connected trace, and /metrics counts it.

Real nats-server, real UCX, real HTTP; the in-process OTLP/HTTP receiver stands in for Jaeger.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.control import trace_cli
from tests.integration.stack import (
    free_port,
    start_nats,
    start_service,
    stop_all,
    wait_http,
    wait_until,
)
from tests.otlp_receiver import OtlpReceiver, to_jaeger

PHASES = {
    "route",
    "prefill.queue",
    "prefill.forward",
    "kv.transfer",
    "decode.queue",
    "decode.generate",
}
REQUESTS = 3


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("obs")
    rx = OtlpReceiver()
    rx.start_in_thread()
    nats = start_nats(logs)
    port = free_port()
    env = rx.env()
    children = [
        start_service("prefill", nats.url, logs, env={**env, "PDSERVE_WORKER_ID": "obs-p0"}),
        start_service("decode", nats.url, logs, env={**env, "PDSERVE_WORKER_ID": "obs-d0"}),
    ]
    children.append(
        start_service("gateway", nats.url, logs, env={**env, "PDSERVE_PORT": str(port)})
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 90, children)
        # health needs only a decode worker; the disaggregated path also needs the prefill one
        wait_until(lambda: "obs-p0" in scrape(f"http://127.0.0.1:{port}"), 30, "prefill worker")
        yield f"http://127.0.0.1:{port}", rx
    finally:
        stop_all(children)
        nats.stop()
        rx.stop_in_thread()


def scrape(base: str) -> str:
    return urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()


def post(url: str, body: dict, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode(), dict(resp.headers)


def test_one_connected_trace_per_request_with_every_phase(traced_stack):
    base, rx = traced_stack
    # a prompt longer than the default local-prefill threshold, so it takes the disaggregated path
    body = {
        "model": "pdserve-demo-llama-v1",
        "prompt": "trace me " * 8,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, headers = post(f"{base}/v1/completions", body, {"x-request-id": "obs-req-1"})
    assert headers["x-request-id"] == "obs-req-1"
    assert text.rstrip().endswith("data: [DONE]")

    def complete(spans) -> bool:
        ours = [s for s in spans if s.attributes.get("pdserve.request_id") == "obs-req-1"]
        # the root ends last (after the stream), so wait for it too
        return PHASES <= {s.name for s in ours} and any(s.parent_span_id is None for s in ours)

    rx.wait_for_sync(complete, timeout=30)
    spans = rx.request_spans("obs-req-1")
    assert len({s.trace_id for s in spans}) == 1
    roots = [s for s in spans if s.parent_span_id is None]
    assert len(roots) == 1
    root = roots[0]
    assert root.service == "pdserve-gateway" and root.name == "POST /v1/completions"
    assert root.kind == 2  # SERVER
    assert {s.service for s in spans} == {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}
    assert PHASES <= {s.name for s in spans}
    ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in ids for s in spans if s is not root)
    for s in spans:
        assert s.attributes.get("pdserve.request_id") == "obs-req-1", s.name
        assert s.resource.get("service.instance.id")
    (kv,) = [s for s in spans if s.name == "kv.transfer"]
    assert kv.resource["service.name"] == "pdserve-decode"
    assert kv.attributes["pdserve.kv.bytes"] > 0 and kv.attributes["pdserve.kv.blocks"] >= 1
    assert kv.attributes["pdserve.kv.transport"] == "ucx"
    assert kv.attributes["pdserve.kv.seconds"] > 0 and kv.attributes["pdserve.kv.gbps"] > 0
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.max_tokens"] == 6
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["gen_ai.usage.input_tokens"] > 8
    assert list(root.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    (gen,) = [s for s in spans if s.name == "decode.generate"]
    assert gen.attributes["gen_ai.usage.output_tokens"] == 5  # the first token came from prefill

    # `pdserve trace` reads exactly such a trace from Jaeger: every phase has time in it
    (trace,) = to_jaeger(spans)["data"]
    b = trace_cli.breakdown(trace)
    assert b.roots == 1 and b.request_id == "obs-req-1"
    assert set(trace_cli.PHASES) <= set(b.phases)
    assert sum(b.phases.values()) + b.other_us == b.total_us


def test_metrics_parse_and_count_the_requests(traced_stack):
    base, _ = traced_stack

    def histogram_count(text: str, name: str) -> float:
        for family in text_string_to_metric_families(text):
            if family.name == name:
                return sum(s.value for s in family.samples if s.name == f"{name}_count")
        raise AssertionError(f"{name} not exported")

    before = scrape(base)
    body = {
        "model": "pdserve-demo-llama-v1",
        "prompt": "count me",
        "max_tokens": 4,
        "temperature": 0,
    }
    for i in range(REQUESTS):
        post(f"{base}/v1/completions", body, {"x-request-id": f"obs-count-{i}"})
    after = scrape(base)
    for name in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds"):
        assert histogram_count(after, name) - histogram_count(before, name) == REQUESTS
    families = {f.name: f for f in text_string_to_metric_families(after)}
    used = [s for s in families["pdserve_kv_cache_used_blocks"].samples]
    assert {s.labels["worker"] for s in used} == {"obs-p0", "obs-d0"}
    total = families["pdserve_kv_cache_total_blocks"].samples
    assert all(s.value > 0 for s in total)


def test_trace_cli_fixture_is_json(tmp_path: Path):
    # the committed fixture stays loadable by the CLI's own parser (kept next to the live test)
    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "jaeger_traces.json"
    data = json.loads(fixture.read_text())
    assert data["data"] and all(trace_cli.breakdown(t).roots == 1 for t in data["data"])
