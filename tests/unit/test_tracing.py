"""pdserve.shared.telemetry.tracing against real OTLP receivers: env-only config, resources, propagation, flushing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.util._once import Once

from pdserve.shared.telemetry import tracing
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver

REPO = Path(__file__).resolve().parents[2]

# A second process: the prefill side of one NATS hop. It never calls shutdown_tracing, so its
# span reaches the receiver only if the atexit flush works (the batch delay is the default 5 s).
PREFILL_PROCESS = """
import json, sys
from pdserve.shared.telemetry import tracing
tracing.setup_tracing(tracing.SERVICE_PREFILL, "prefill-test-1")
incoming = json.loads(sys.argv[1])
ctx = tracing.extract_context(incoming)
attrs = {tracing.ATTR_REQUEST_ID: "req-hop"}
with tracing.tracer("prefill").start_as_current_span("prefill.queue", context=ctx, attributes=attrs):
    outgoing = tracing.inject_headers()
print(json.dumps(outgoing))
"""


def _reset_global_provider() -> None:
    # The API lets a process set its provider once; each test here plays a fresh process.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    _reset_global_provider()
    yield
    tracing.shutdown_tracing()
    _reset_global_provider()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture
def rx(receiver: OtlpReceiver) -> OtlpReceiver:
    receiver.clear()
    return receiver


def _use(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_no_endpoint_keeps_noop_provider_but_still_propagates() -> None:
    tracing.setup_tracing(tracing.SERVICE_GATEWAY, "gw-1")
    assert not tracing.tracing_enabled()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)

    incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    ctx = tracing.extract_context(incoming)
    with tracing.tracer(__name__).start_as_current_span("route", context=ctx) as span:
        assert not span.is_recording()
        # An untraced hop in the middle must not break the trace of the hops around it.
        assert tracing.inject_headers()["traceparent"] == incoming["traceparent"]
    assert tracing.inject_headers() == {}


def test_extract_matches_header_names_in_any_case() -> None:
    value = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for name in ("traceparent", "Traceparent", "TRACEPARENT"):
        ctx = trace.get_current_span(tracing.extract_context({name: value})).get_span_context()
        assert (ctx.trace_id, ctx.span_id, ctx.is_remote) == (
            0x0AF7651916CD43DD8448EB211C80319C,
            0xB7AD6B7169203331,
            True,
        )
    assert not trace.get_current_span(tracing.extract_context(None)).get_span_context().is_valid
    assert (
        not trace.get_current_span(tracing.extract_context({"traceparent": "junk"}))
        .get_span_context()
        .is_valid
    )


def test_sdk_disabled_wins_over_endpoint(monkeypatch: pytest.MonkeyPatch, rx: OtlpReceiver) -> None:
    _use(monkeypatch, rx.env(OTEL_SDK_DISABLED="true"))
    tracing.setup_tracing(tracing.SERVICE_GATEWAY, "gw-1")
    assert not tracing.tracing_enabled()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


@pytest.mark.parametrize(
    "env,enabled",
    [
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),  # named: the spec's default endpoint
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, False),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, False),  # a protocol alone is no destination
    ],
)
def test_which_env_turns_export_on(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], enabled: bool
) -> None:
    _use(monkeypatch, env)
    tracing.setup_tracing(tracing.SERVICE_PREFILL, "p-1")
    assert tracing.tracing_enabled() is enabled
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) is not enabled


def test_spans_cross_a_header_hop_into_one_trace(
    monkeypatch: pytest.MonkeyPatch, rx: OtlpReceiver
) -> None:
    _use(monkeypatch, {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint})
    tracing.setup_tracing(tracing.SERVICE_GATEWAY, "gw-test")
    assert tracing.tracing_enabled()
    gw = tracing.tracer("gateway")
    with gw.start_as_current_span(
        "POST /v1/completions",
        kind=trace.SpanKind.SERVER,
        attributes={tracing.ATTR_REQUEST_ID: "req-hop"},
    ) as root:
        headers = tracing.inject_headers({"Nats-Msg-Id": "keep-me"})
    assert headers["Nats-Msg-Id"] == "keep-me"
    root_ctx = root.get_span_context()
    # Flags: sampled, plus the W3C level-2 "random trace id" bit newer SDKs set.
    assert headers["traceparent"].startswith(
        f"00-{root_ctx.trace_id:032x}-{root_ctx.span_id:016x}-"
    )

    child_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    child_env.update(rx.env(PYTHONPATH=str(REPO)))
    del child_env["OTEL_BSP_SCHEDULE_DELAY"]  # default 5 s: only the atexit flush exports in time
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", PREFILL_PROCESS, json.dumps(headers)],
        env=child_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 4.5, "child waited for the batch timer instead of flushing"
    from_prefill = json.loads(proc.stdout)

    # The third hop (decode) continues from what prefill sent on.
    with gw.start_as_current_span(
        "decode.generate",
        context=tracing.extract_context(from_prefill),
        attributes={tracing.ATTR_REQUEST_ID: "req-hop"},
    ):
        pass
    # Nothing of this process was exported yet (5 s batch delay); shutdown must flush it.
    tracing.shutdown_tracing()
    spans = {s.name: s for s in rx.request_spans("req-hop")}
    assert set(spans) == {"POST /v1/completions", "prefill.queue", "decode.generate"}

    root_span, prefill, decode = (
        spans["POST /v1/completions"],
        spans["prefill.queue"],
        spans["decode.generate"],
    )
    assert {s.trace_id for s in spans.values()} == {f"{root_ctx.trace_id:032x}"}
    assert root_span.parent_span_id is None
    assert root_span.kind == 2  # SERVER
    assert prefill.parent_span_id == root_span.span_id
    assert decode.parent_span_id == prefill.span_id
    assert root_span.resource["service.name"] == "pdserve-gateway"
    assert root_span.resource["service.instance.id"] == "gw-test"
    assert prefill.resource["service.name"] == "pdserve-prefill"
    assert prefill.resource["service.instance.id"] == "prefill-test-1"
    assert all(s.attributes[tracing.ATTR_REQUEST_ID] == "req-hop" for s in spans.values())


def test_grpc_protocol_exports_over_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpGrpcReceiver() as grx:
        _use(monkeypatch, grx.env())
        tracing.setup_tracing(tracing.SERVICE_DECODE, "decode-7")
        with tracing.tracer("decode").start_as_current_span("decode.generate"):
            pass
        tracing.shutdown_tracing()
        [span] = grx.wait_for_sync(lambda spans: len(spans) >= 1, timeout=5)
    assert span.name == "decode.generate"
    assert span.resource["service.name"] == "pdserve-decode"
    assert span.resource["service.instance.id"] == "decode-7"


def test_standard_env_vars_shape_resource_and_sampling(
    monkeypatch: pytest.MonkeyPatch, rx: OtlpReceiver
) -> None:
    _use(
        monkeypatch,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.traces_endpoint,
            "OTEL_SERVICE_NAME": "edge-gateway",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.instance.id=ignored",
        },
    )
    tracing.setup_tracing(tracing.SERVICE_GATEWAY, "gw-9")
    with tracing.tracer("t").start_as_current_span("route"):
        pass
    tracing.shutdown_tracing()
    [span] = rx.spans
    assert span.resource["service.name"] == "edge-gateway"
    assert span.resource["deployment.environment"] == "test"
    # The caller's id is what makes instances distinguishable; the env cannot collapse them.
    assert span.resource["service.instance.id"] == "gw-9"


def test_sampler_comes_from_env(monkeypatch: pytest.MonkeyPatch, rx: OtlpReceiver) -> None:
    _use(monkeypatch, rx.env(OTEL_TRACES_SAMPLER="always_off"))
    tracing.setup_tracing(tracing.SERVICE_GATEWAY, "gw-1")
    assert tracing.tracing_enabled()
    with tracing.tracer("t").start_as_current_span("route") as span:
        assert not span.is_recording()
    tracing.shutdown_tracing()
    assert rx.spans == [] and rx.requests == 0


def test_unknown_protocol_is_refused(monkeypatch: pytest.MonkeyPatch, rx: OtlpReceiver) -> None:
    _use(monkeypatch, rx.env(OTEL_EXPORTER_OTLP_PROTOCOL="http/json"))
    with pytest.raises(ValueError, match="http/json"):
        tracing.setup_tracing(tracing.SERVICE_GATEWAY, "gw-1")


def test_record_span_keeps_measured_times_and_kv_attributes(
    monkeypatch: pytest.MonkeyPatch, rx: OtlpReceiver
) -> None:
    _use(monkeypatch, rx.env())
    tracing.setup_tracing(tracing.SERVICE_DECODE, "decode-1")
    start = time.time_ns() - 50_000_000
    end = start + 20_000_000
    attrs = tracing.kv_transfer_attributes("req-kv", 8 << 20, 4, 0.004, "ucx")
    with tracing.tracer("t").start_as_current_span("root") as root:
        tracing.record_span(tracing.SPAN_KV_TRANSFER, start, end, attributes=attrs)
    tracing.shutdown_tracing()
    tracing.shutdown_tracing()  # idempotent
    spans = {s.name: s for s in rx.spans}
    kv = spans["kv.transfer"]
    assert (kv.start_ns, kv.end_ns) == (start, end)
    assert kv.parent_span_id == f"{root.get_span_context().span_id:016x}"
    assert kv.attributes == {
        "pdserve.request_id": "req-kv",
        "pdserve.kv.bytes": 8 << 20,
        "pdserve.kv.blocks": 4,
        "pdserve.kv.seconds": 0.004,
        "pdserve.kv.gbps": pytest.approx((8 << 20) / 0.004 / 1e9),
        "pdserve.kv.transport": "ucx",
    }
