"""``pdserve trace`` against a Jaeger query-API stand-in serving traces the SDK really exported.

The fixture ``tests/fixtures/jaeger_traces.json`` is made by :func:`export_scenarios`: three
requests' spans go through the OpenTelemetry SDK, the OTLP/HTTP exporter, our in-process
receiver and ``to_jaeger``, with the design's span names and parents and known phase times.
``python -m tests.unit.test_trace_cli`` rewrites it; a test checks a fresh export still matches.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from pdserve.services.control import trace_cli
from pdserve.shared.telemetry import tracing
from tests.otlp_receiver import OtlpReceiver, to_jaeger

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "jaeger_traces.json"
BASE_NS = 1_796_202_000 * 10**9  # 2026-12-02 09:00:00 UTC
MS = 1_000_000

# --- the scenarios: what one request of each kind looks like in a trace -------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    service: str
    start_ms: float
    end_ms: float
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    request_id: str
    root_ms: float
    root_attributes: dict[str, Any]
    phases: list[Phase]


def _root_attrs(rid: str, prompt: int, output: int, reason: str, ttft: float, e2e: float):
    return {
        tracing.ATTR_REQUEST_ID: rid,
        "http.request.method": "POST",
        "http.response.status_code": 200,
        tracing.GEN_AI_OPERATION_NAME: "chat",
        tracing.GEN_AI_REQUEST_MODEL: "pdserve-demo",
        tracing.GEN_AI_REQUEST_MAX_TOKENS: output,
        tracing.GEN_AI_REQUEST_TEMPERATURE: 0.7,
        tracing.GEN_AI_REQUEST_TOP_P: 0.9,
        tracing.GEN_AI_USAGE_INPUT_TOKENS: prompt,
        tracing.GEN_AI_USAGE_OUTPUT_TOKENS: output,
        tracing.GEN_AI_RESPONSE_FINISH_REASONS: [reason],
        tracing.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: ttft,
        tracing.GEN_AI_LATENCY_E2E: e2e,
    }


def _forward(rid: str, batch: int, tokens: int) -> dict[str, Any]:
    return {
        tracing.ATTR_REQUEST_ID: rid,
        tracing.ATTR_BATCH_SIZE: batch,
        tracing.ATTR_BATCH_TOKENS: tokens,
        tracing.ATTR_CACHED_TOKENS: 0,
    }


def _generate(rid: str, tokens: int, tpot_ms: float) -> dict[str, Any]:
    return {
        tracing.ATTR_REQUEST_ID: rid,
        tracing.GEN_AI_USAGE_OUTPUT_TOKENS: tokens,
        tracing.ATTR_TPOT_MS: tpot_ms,
    }


def _rid(rid: str) -> dict[str, Any]:
    return {tracing.ATTR_REQUEST_ID: rid}


P, D, G = tracing.SERVICE_PREFILL, tracing.SERVICE_DECODE, tracing.SERVICE_GATEWAY
SCENARIOS = [
    # Disaggregated: prefill worker, UCX pull, decode worker.
    Scenario(
        "req-disagg-1",
        500,
        _root_attrs("req-disagg-1", 100, 44, "length", 0.055, 0.5),
        [
            Phase("route", G, 1, 2, _rid("req-disagg-1")),
            Phase("prefill.queue", P, 3, 13, _rid("req-disagg-1")),
            Phase("prefill.forward", P, 13, 53, _forward("req-disagg-1", 2, 160)),
            Phase("decode.queue", D, 56, 60, _rid("req-disagg-1")),
            Phase(
                "kv.transfer",
                D,
                60,
                65,
                tracing.kv_transfer_attributes("req-disagg-1", 8_388_608, 4, 0.005, "ucx"),
            ),
            Phase("decode.generate", D, 65, 495, _generate("req-disagg-1", 44, 10.0)),
        ],
    ),
    # A long prompt prefilled in two chunks.
    Scenario(
        "req-chunked-2",
        1000,
        _root_attrs("req-chunked-2", 3000, 50, "stop", 0.44, 1.0),
        [
            Phase("route", G, 0.5, 1.5, _rid("req-chunked-2")),
            Phase("prefill.queue", P, 2, 32, _rid("req-chunked-2")),
            Phase("prefill.forward", P, 32, 232, _forward("req-chunked-2", 1, 2048)),
            Phase("prefill.forward", P, 232, 432, _forward("req-chunked-2", 1, 952)),
            Phase("decode.queue", D, 435, 440, _rid("req-chunked-2")),
            Phase(
                "kv.transfer",
                D,
                440,
                490,
                tracing.kv_transfer_attributes("req-chunked-2", 251_658_240, 188, 0.05, "ucx"),
            ),
            Phase("decode.generate", D, 490, 988, _generate("req-chunked-2", 50, 10.16)),
        ],
    ),
    # A short prompt prefilled locally by the decode worker: no prefill service, no KV transfer.
    Scenario(
        "req-local-3",
        230,
        _root_attrs("req-local-3", 12, 21, "stop", 0.03, 0.23),
        [
            Phase("route", G, 0.5, 1.0, _rid("req-local-3")),
            Phase("decode.queue", D, 2, 7, _rid("req-local-3")),
            Phase("prefill.forward", D, 7, 27, _forward("req-local-3", 3, 40)),
            Phase("decode.generate", D, 27, 227, _generate("req-local-3", 21, 10.0)),
        ],
    ),
]

# What `pdserve trace` must print for them: (time, share) per phase; shares of the root span.
EXPECTED = {
    "req-disagg-1": {
        "queue": ("14.0 ms", "2.8%"),
        "prefill": ("40.0 ms", "8.0%"),
        "kv transfer": ("5.0 ms", "1.0%"),
        "decode": ("430.0 ms", "86.0%"),
        "other": ("11.0 ms", "2.2%"),
        "total": ("500.0 ms", "100.0%"),
    },
    "req-chunked-2": {
        "queue": ("35.0 ms", "3.5%"),
        "prefill": ("400.0 ms", "40.0%"),
        "kv transfer": ("50.0 ms", "5.0%"),
        "decode": ("498.0 ms", "49.8%"),
        "other": ("17.0 ms", "1.7%"),
        "total": ("1000.0 ms", "100.0%"),
    },
    "req-local-3": {
        "queue": ("5.0 ms", "2.2%"),
        "prefill": ("20.0 ms", "8.7%"),
        "kv transfer": ("-", "-"),
        "decode": ("200.0 ms", "87.0%"),
        "other": ("5.0 ms", "2.2%"),
        "total": ("230.0 ms", "100.0%"),
    },
}


def export_scenarios(receiver: OtlpReceiver) -> dict[str, Any]:
    """Export every scenario through the SDK to ``receiver``; return Jaeger's JSON of them."""
    providers = {}
    for service, instance in ((G, "gw-0"), (P, "prefill-0"), (D, "decode-0")):
        provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service, SERVICE_INSTANCE_ID: instance}),
            shutdown_on_exit=False,
        )
        exporter = OTLPSpanExporter(endpoint=receiver.traces_endpoint)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        providers[service] = provider
    scopes = {
        G: "pdserve.gateway.server",
        P: "pdserve.services.prefill.worker",
        D: "pdserve.services.decode.worker",
    }
    tracers = {s: p.get_tracer(scopes[s]) for s, p in providers.items()}

    for i, sc in enumerate(SCENARIOS):
        base = BASE_NS + i * 60 * 10**9
        root = tracers[G].start_span(
            "POST /v1/chat/completions",
            kind=trace.SpanKind.SERVER,
            start_time=base,
            attributes=sc.root_attributes,
        )
        # As in the gateway: the root's context rides in the NATS headers of every message.
        headers = tracing.inject_headers(context=trace.set_span_in_context(root))
        for ph in sc.phases:
            # As in the workers: the parent comes from the received headers, not from memory.
            parent = (
                trace.set_span_in_context(root)
                if ph.service == G
                else tracing.extract_context(headers)
            )
            span = tracers[ph.service].start_span(
                ph.name,
                context=parent,
                start_time=base + int(ph.start_ms * MS),
                attributes=ph.attributes,
            )
            span.end(end_time=base + int(ph.end_ms * MS))
        root.end(end_time=base + int(sc.root_ms * MS))

    for provider in providers.values():
        provider.shutdown()  # flushes
    want = sum(1 + len(sc.phases) for sc in SCENARIOS)
    return to_jaeger(receiver.wait_for_sync(lambda spans: len(spans) >= want, timeout=10))


# --- a Jaeger query-API stand-in over real HTTP ----------------------------------------------


class JaegerStandIn:
    """Answers ``GET /api/traces`` from fixture traces the way Jaeger's query service does."""

    def __init__(self, traces: list[dict[str, Any]]) -> None:
        self.traces = traces
        self.queries: list[dict[str, str]] = []
        self.fail_with: dict[str, Any] | None = None

    @staticmethod
    def _matches(trace_: dict[str, Any], service: str, tags: dict[str, str]) -> bool:
        processes = trace_["processes"]
        for span in trace_["spans"]:
            if processes[span["processID"]]["serviceName"] != service:
                continue
            span_tags = {t["key"]: str(t["value"]) for t in span["tags"]}
            if all(span_tags.get(k) == str(v) for k, v in tags.items()):
                return True
        return False

    async def handle(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        self.queries.append(query)
        if self.fail_with is not None:
            return web.json_response(self.fail_with, status=self.fail_with["errors"][0]["code"])
        service = query.get("service")
        if not service:
            err = {"code": 400, "msg": "parameter 'service' is required"}
            return web.json_response({"data": None, "errors": [err]}, status=400)
        tags = json.loads(query.get("tags", "{}"))
        limit = int(query.get("limit", "100"))
        found = [t for t in self.traces if self._matches(t, service, tags)]
        found.sort(key=lambda t: min(s["startTime"] for s in t["spans"]), reverse=True)
        return web.json_response(
            {"data": found[:limit], "total": 0, "limit": 0, "offset": 0, "errors": None}
        )


@pytest.fixture(scope="module")
def fixture_traces() -> list[dict[str, Any]]:
    return json.loads(FIXTURE.read_text())["data"]


@pytest.fixture
async def jaeger(fixture_traces) -> AsyncIterator[tuple[JaegerStandIn, str]]:
    stand_in = JaegerStandIn(copy.deepcopy(fixture_traces))
    app = web.Application()
    app.router.add_get("/api/traces", stand_in.handle)
    async with TestServer(app, host="127.0.0.1") as server:
        yield stand_in, str(server.make_url("/")).rstrip("/")


async def cli(base_url: str, *argv: str) -> tuple[int, str]:
    """Run ``pdserve trace`` with the real argument parser; the CLI is blocking, so in a thread."""
    from pdserve.cli import make_parser

    ns = make_parser().parse_args(["trace", "--jaeger", base_url, *argv])
    out = io.StringIO()
    code = await asyncio.to_thread(trace_cli.run, ns, out)
    return code, out.getvalue()


def phase_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        m = re.match(
            r"^  (queue|prefill|kv transfer|decode|other|total)\s+(-|[\d.]+ m?s)\s+(\S+)", line
        )
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


# --- tests -----------------------------------------------------------------------------------


def test_fresh_export_matches_the_committed_fixture(fixture_traces) -> None:
    with OtlpReceiver() as rx:
        fresh = export_scenarios(rx)["data"]
    assert len(fresh) == len(fixture_traces) == len(SCENARIOS)
    fresh_rows = {b.request_id: b for b in map(trace_cli.breakdown, fresh)}
    for old in map(trace_cli.breakdown, fixture_traces):
        new = fresh_rows[old.request_id]
        assert (new.phases, new.other_us, new.total_us, new.services, new.roots) == (
            old.phases,
            old.other_us,
            old.total_us,
            old.services,
            old.roots,
        )
    for tr in fresh:
        [root] = trace_cli.find_roots(tr)
        assert root["operationName"] == "POST /v1/chat/completions"
        assert {"key": "span.kind", "type": "string", "value": "server"} in root["tags"]
        for span in tr["spans"]:
            tags = {t["key"]: t["value"] for t in span["tags"]}
            assert tags[tracing.ATTR_REQUEST_ID] == tags_of(root)[tracing.ATTR_REQUEST_ID]
            if span is not root:  # every phase hangs directly off the gateway's root span
                assert span["references"] == [
                    {"refType": "CHILD_OF", "traceID": tr["traceID"], "spanID": root["spanID"]}
                ]


def tags_of(span: dict[str, Any]) -> dict[str, Any]:
    return {t["key"]: t["value"] for t in span["tags"]}


@pytest.mark.parametrize("request_id", sorted(EXPECTED))
async def test_request_breakdown(jaeger, request_id: str) -> None:
    stand_in, url = jaeger
    code, text = await cli(url, request_id)
    assert code == 0, text
    assert stand_in.queries == [
        {
            "service": "pdserve-gateway",
            "tags": json.dumps({"pdserve.request_id": request_id}),
            "limit": "20",
        }
    ]
    assert text.startswith(f"request {request_id}  trace ")
    assert phase_rows(text) == EXPECTED[request_id]


async def test_breakdown_details(jaeger) -> None:
    _, url = jaeger
    code, text = await cli(url, "req-disagg-1")
    assert code == 0
    assert "services: pdserve-decode, pdserve-gateway, pdserve-prefill" in text
    assert "8.4 MB, 4 blocks, 1.68 GB/s, over ucx" in text
    assert "44 tokens, 10.0 ms/token" in text
    assert "model pdserve-demo; 100 prompt tokens; 44 output tokens; finish length" in text
    assert "time to first token 55.0 ms" in text
    assert "2026-12-02 09:00:00.000 UTC" in text


async def test_last_n_lists_newest_first(jaeger) -> None:
    stand_in, url = jaeger
    code, text = await cli(url, "--last", "2")
    assert code == 0, text
    assert stand_in.queries == [{"service": "pdserve-gateway", "limit": "2"}]
    header, *rows, mean = text.strip().splitlines()
    assert header.split() == [
        "request",
        "start",
        "(UTC)",
        "queue",
        "prefill",
        "kv",
        "transfer",
        "decode",
        "other",
        "total",
    ]
    assert [r.split()[0] for r in rows] == ["req-local-3", "req-chunked-2"]
    cells = rows[1].split()
    # start, then (time, unit, share) for queue, prefill, kv transfer, decode, other, then total
    assert cells[1] == "09:01:00.000"
    assert cells[2:] == (
        ["35.0", "ms", "3.5%", "400.0", "ms", "40.0%", "50.0", "ms", "5.0%"]
        + ["498.0", "ms", "49.8%", "17.0", "ms", "1.7%", "1000.0", "ms"]
    )
    assert rows[0].split()[8] == "-"  # local prefill: no KV transfer
    # Means over both: queue (5+35)/2, prefill (20+400)/2, kv (0+50)/2, total (230+1000)/2.
    assert mean.split()[:10] == [
        "mean",
        "20.0",
        "ms",
        "3.3%",
        "210.0",
        "ms",
        "34.1%",
        "25.0",
        "ms",
        "4.1%",
    ]
    assert mean.split()[-2:] == ["615.0", "ms"]


async def test_default_lists_recent_requests(jaeger) -> None:
    stand_in, url = jaeger
    code, text = await cli(url)
    assert code == 0
    assert stand_in.queries[0]["limit"] == str(trace_cli.DEFAULT_LAST)
    assert len(text.strip().splitlines()) == 1 + len(SCENARIOS) + 1  # header, rows, mean


async def test_unknown_request_exits_1(jaeger, capsys) -> None:
    _, url = jaeger
    code, text = await cli(url, "req-nope")
    assert (code, text) == (1, "")
    assert "no trace of request req-nope" in capsys.readouterr().err


async def test_jaeger_errors_exit_2(jaeger, capsys) -> None:
    stand_in, url = jaeger
    stand_in.fail_with = {"data": None, "errors": [{"code": 500, "msg": "storage unavailable"}]}
    assert (await cli(url, "req-disagg-1"))[0] == 2
    assert "storage unavailable" in capsys.readouterr().err

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert (await cli(dead, "req-disagg-1"))[0] == 2
    assert "cannot reach Jaeger" in capsys.readouterr().err


def test_missing_parent_is_reported(fixture_traces) -> None:
    tr = copy.deepcopy(next(t for t in fixture_traces if "req-disagg-1" in json.dumps(t)))
    root = trace_cli.find_roots(tr)[0]
    # The decode worker's spans point at a parent that never reached Jaeger.
    for span in tr["spans"]:
        if span["operationName"].startswith("decode") or span["operationName"] == "kv.transfer":
            span["references"][0]["spanID"] = "00000000deadbeef"
    b = trace_cli.breakdown(tr)
    assert b.roots == 4
    assert b.root_name == root["operationName"] and b.total_us == 500_000
    assert "warning: 4 spans without a parent" in trace_cli.format_breakdown(b)


def test_phase_time_is_a_union_not_a_sum() -> None:
    # Overlapping and out-of-root ranges: [0,10] + [5,20] + [30,40] clipped to the root.
    assert trace_cli._union_us([(0, 10), (5, 20), (30, 40)]) == 30
    assert trace_cli._union_us([(30, 40), (0, 10), (10, 10)]) == 20
    assert trace_cli._union_us([]) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description="rewrite the pdserve trace fixture")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    with OtlpReceiver() as rx:
        data = export_scenarios(rx)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}: {len(data['data'])} traces")


if __name__ == "__main__":
    main()
