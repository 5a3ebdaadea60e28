"""In-process OTLP receivers for tests, and a converter to Jaeger's query-API JSON.

``OtlpReceiver`` is a real OTLP/HTTP endpoint (aiohttp, ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` protobuf body, optionally gzipped), so processes under test export
through the unmodified OpenTelemetry SDK. Point them at it with ``receiver.env()``.

Async tests::

    async with OtlpReceiver() as rx:
        ...  # run things with OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint
        spans = await rx.wait_for(lambda spans: len(spans) >= 7)

Sync tests run the receiver's event loop in a background thread::

    with OtlpReceiver() as rx:
        spans = rx.wait_for_sync(lambda spans: any(s.name == "decode.generate" for s in spans))

``OtlpGrpcReceiver`` accepts the same data over OTLP/gRPC (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``).
``to_jaeger(spans)`` renders collected spans as Jaeger's ``/api/traces`` response, which is how
the ``pdserve trace`` fixtures are made from spans a real run exported.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

MAX_BODY_BYTES = 64 * 1024 * 1024
PROTOBUF = "application/x-protobuf"

# OTLP Span.SpanKind values -> the names Jaeger shows in its ``span.kind`` tag.
_KIND_NAMES = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS_NAMES = {1: "OK", 2: "ERROR"}


@dataclass
class ReceivedSpan:
    """One span as it arrived, with ids as lowercase hex like Jaeger shows them."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int  # OTLP Span.SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _any_value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _attributes(kvs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def spans_from_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Flatten an OTLP export request into spans that each carry their resource."""
    out: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        kind=int(span.kind),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        resource=resource,
                        scope=scope_spans.scope.name,
                        status_code=int(span.status.code),
                        status_message=span.status.message,
                        events=[
                            {
                                "name": e.name,
                                "time_ns": e.time_unix_nano,
                                "attributes": _attributes(e.attributes),
                            }
                            for e in span.events
                        ],
                    )
                )
    return out


class _SpanStore:
    """Thread-safe span list shared by the HTTP and gRPC receivers."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self.requests = 0  # export calls received, for tests of batching and flushing

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self._spans.extend(spans)
            self.requests += 1
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()
            self.requests = 0

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """Spans grouped by trace id, each group in start order."""
        out: dict[str, list[ReceivedSpan]] = {}
        for span in sorted(self.spans, key=lambda s: s.start_ns):
            out.setdefault(span.trace_id, []).append(span)
        return out

    def request_spans(self, client_id: str) -> list[ReceivedSpan]:
        """Every span of the trace(s) in which some span carries ``pdserve.request_id``."""
        spans = self.spans
        ids = {s.trace_id for s in spans if s.attributes.get("pdserve.request_id") == client_id}
        return sorted((s for s in spans if s.trace_id in ids), key=lambda s: s.start_ns)

    def wait_for_sync(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        """Block until ``predicate(spans)`` holds; raise TimeoutError with what did arrive."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted((s.service, s.name) for s in self._spans)
                    raise TimeoutError(f"spans never matched; received {names}")
                self._cond.wait(left)
            return list(self._spans)

    async def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        """Async twin of :meth:`wait_for_sync` (polls, so it never blocks the event loop)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in spans)
                raise TimeoutError(f"spans never matched; received {names}")
            await asyncio.sleep(0.02)


class OtlpReceiver(_SpanStore):
    """OTLP/HTTP trace receiver on 127.0.0.1 and a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def endpoint(self) -> str:
        """Base URL, the value for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def traces_endpoint(self) -> str:
        """Full URL, the value for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``."""
        return f"{self.endpoint}/v1/traces"

    def env(self, **extra: str) -> dict[str, str]:
        """OTEL_* variables that make a process export here over http/protobuf, promptly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms; spans show up quickly, not only at exit
            **extra,
        }

    async def _handle(self, request: web.Request) -> web.Response:
        content_type = request.content_type
        if content_type != PROTOBUF:
            return web.Response(status=415, text=f"only {PROTOBUF} is accepted, got {content_type}")
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "").lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            message = trace_service_pb2.ExportTraceServiceRequest()
            message.ParseFromString(body)
        except Exception as exc:  # any decode failure is the client's fault: 400, as OTLP says
            return web.Response(status=400, text=f"bad OTLP body: {exc}")
        self.add(spans_from_request(message))
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type=PROTOBUF)

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/traces", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> OtlpReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start_in_thread(self) -> None:
        """Serve from a private event loop in a daemon thread (for sync tests)."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # surface bind errors in the caller's thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=serve, name="otlp-receiver", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]

    def stop_in_thread(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None
            self._loop = None

    def __enter__(self) -> OtlpReceiver:
        self.start_in_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_in_thread()


class OtlpGrpcReceiver(_SpanStore):
    """OTLP/gRPC trace receiver (grpcio server threads) on 127.0.0.1 and a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        import grpc

        store = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (gRPC method name)
                store.add(spans_from_request(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:{port}")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **extra,
        }

    def __enter__(self) -> OtlpGrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


# --- Jaeger query-API JSON -------------------------------------------------------------------


def _jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    # Jaeger's OTLP ingest keeps scalar types and stores arrays/maps as JSON strings.
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, bytes):
        return {"key": key, "type": "binary", "value": value.hex()}
    if isinstance(value, (list, dict)):
        return {"key": key, "type": "string", "value": json.dumps(value)}
    return {"key": key, "type": "string", "value": str(value)}


def _jaeger_span(span: ReceivedSpan, process_id: str) -> dict[str, Any]:
    tags = [_jaeger_tag(k, v) for k, v in span.attributes.items()]
    tags.append(_jaeger_tag("otel.scope.name", span.scope))
    if span.kind in _KIND_NAMES:
        tags.append(_jaeger_tag("span.kind", _KIND_NAMES[span.kind]))
    if span.status_code in _STATUS_NAMES:
        tags.append(_jaeger_tag("otel.status_code", _STATUS_NAMES[span.status_code]))
        if span.status_code == 2:
            tags.append(_jaeger_tag("error", True))
            if span.status_message:
                tags.append(_jaeger_tag("otel.status_description", span.status_message))
    references = []
    if span.parent_span_id:
        references.append(
            {"refType": "CHILD_OF", "traceID": span.trace_id, "spanID": span.parent_span_id}
        )
    return {
        "traceID": span.trace_id,
        "spanID": span.span_id,
        "operationName": span.name,
        "references": references,
        "startTime": span.start_ns // 1000,  # Jaeger speaks microseconds
        "duration": (span.end_ns - span.start_ns) // 1000,
        "tags": tags,
        "logs": [
            {
                "timestamp": e["time_ns"] // 1000,
                "fields": [_jaeger_tag("event", e["name"])]
                + [_jaeger_tag(k, v) for k, v in e["attributes"].items()],
            }
            for e in span.events
        ],
        "processID": process_id,
        "warnings": None,
    }


def to_jaeger_trace(spans: list[ReceivedSpan]) -> dict[str, Any]:
    """One trace (spans sharing a trace id) as an element of Jaeger's ``data`` list."""
    processes: dict[str, dict[str, Any]] = {}
    process_ids: dict[str, str] = {}
    out_spans = []
    for span in sorted(spans, key=lambda s: (s.start_ns, s.span_id)):
        key = json.dumps(span.resource, sort_keys=True, default=str)
        if key not in process_ids:
            pid = f"p{len(process_ids) + 1}"
            process_ids[key] = pid
            processes[pid] = {
                "serviceName": span.service,
                "tags": [
                    _jaeger_tag(k, v) for k, v in span.resource.items() if k != "service.name"
                ],
            }
        out_spans.append(_jaeger_span(span, process_ids[key]))
    return {
        "traceID": spans[0].trace_id,
        "spans": out_spans,
        "processes": processes,
        "warnings": None,
    }


def to_jaeger(spans: Iterable[ReceivedSpan]) -> dict[str, Any]:
    """Collected spans as a Jaeger ``GET /api/traces`` response body, newest trace first."""
    by_trace: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    ordered = sorted(by_trace.values(), key=lambda ss: min(s.start_ns for s in ss), reverse=True)
    data = [to_jaeger_trace(group) for group in ordered]
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}
