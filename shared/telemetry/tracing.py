"""OpenTelemetry tracing for every pdserve process.

Configuration comes only from the standard ``OTEL_*`` environment variables, read by the SDK
itself wherever it can:

- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``: where spans go. With
  neither set (and ``OTEL_TRACES_EXPORTER`` not naming ``otlp`` or ``console``) no SDK provider
  is installed at all: the API's no-op tracer stays in place and a span is a few microseconds
  of non-recording bookkeeping. ``OTEL_TRACES_EXPORTER=none`` turns export off explicitly.
- ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``
  (default) or ``grpc``.
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_PROPAGATORS``, ``OTEL_EXPORTER_OTLP_HEADERS``... are honoured by the SDK as usual.
- ``OTEL_SERVICE_NAME``, when set, replaces the caller's service name (standard precedence).
  A launcher that starts several roles from one environment should not set it.
- ``OTEL_SDK_DISABLED=true`` turns everything off.

One request is one trace. The gateway's HTTP server span is the root; the gateway injects the
root's context into the NATS headers of every message it sends for the request, so every worker
phase span is a direct child of the root::

    POST /v1/chat/completions   gateway  SERVER  gen_ai.* request attributes
    ├── route                   gateway          worker choice
    ├── prefill.queue           prefill          arrival -> scheduled
    ├── prefill.forward         prefill          one per forward pass (chunk) of the request
    ├── decode.queue            decode           arrival -> KV pull / first step
    ├── kv.transfer             decode           UCX pull of the prefill worker's blocks
    └── decode.generate         decode           first decode step -> finish

Every span carries ``pdserve.request_id``. Phases measured inside a batched engine step are
recorded after the fact with :func:`record_span` (explicit start/end times from ``time.time_ns()``).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from pdserve.shared.telemetry.roofline import Roofline

# --- span names (the trace CLI and the integration tests look for exactly these) -----------------
SPAN_ROUTE = "route"
SPAN_PREFILL_QUEUE = "prefill.queue"
SPAN_PREFILL_FORWARD = "prefill.forward"
SPAN_KV_TRANSFER = "kv.transfer"
SPAN_DECODE_QUEUE = "decode.queue"
SPAN_DECODE_GENERATE = "decode.generate"

# --- service names (resource service.name) ----------------------------------------------------
SERVICE_GATEWAY = "pdserve-gateway"
SERVICE_PREFILL = "pdserve-prefill"
SERVICE_DECODE = "pdserve-decode"

# --- pdserve attributes -----------------------------------------------------------------------
ATTR_REQUEST_ID = "pdserve.request_id"
ATTR_WORKER_ID = "pdserve.worker_id"
ATTR_BATCH_SIZE = "pdserve.batch_size"  # sequences in the forward pass
ATTR_BATCH_TOKENS = "pdserve.batch_tokens"  # tokens in the forward pass
ATTR_CACHED_TOKENS = "pdserve.cached_tokens"  # prompt tokens served from the prefix cache
ATTR_KV_BYTES = "pdserve.kv.bytes"
ATTR_KV_BLOCKS = "pdserve.kv.blocks"
ATTR_KV_SECONDS = "pdserve.kv.seconds"
ATTR_KV_GBPS = "pdserve.kv.gbps"  # decimal gigabytes per second
ATTR_KV_TRANSPORT = "pdserve.kv.transport"  # e.g. "ucx", "local"
ATTR_KV_CHECKSUM = "pdserve.kv.checksum"  # --kv-checksum: "ok", or "mismatch" (a failed pull)
ATTR_TPOT_MS = "pdserve.tpot_ms"  # time per output token after the first, milliseconds
# roofline (roofline.py): on prefill.forward the step's, on decode.generate the worker's decode
# steps over the request's decode lifetime
ATTR_ROOFLINE_INTENSITY = "pdserve.roofline.intensity"  # FLOP per byte moved
ATTR_ROOFLINE_COMPUTE_FRACTION = "pdserve.roofline.compute_fraction"  # of the peak FLOP/s
ATTR_ROOFLINE_BANDWIDTH_FRACTION = "pdserve.roofline.bandwidth_fraction"  # of the peak bytes/s
ATTR_ROOFLINE_BOUND = "pdserve.roofline.bound"  # "compute" or "memory"

# --- span events ------------------------------------------------------------------------------
# On the request's root span when the gateway migrates it off a lost decode worker.
EVENT_MIGRATION = "pdserve.migration"
ATTR_MIGRATION_REASON = "pdserve.migration.reason"  # "worker_lost" or "bus_reconnect"
ATTR_MIGRATION_FROM = "pdserve.migration.from_workers"  # list[str]
ATTR_MIGRATION_TO = "pdserve.migration.to_workers"  # list[str]
ATTR_MIGRATION_TOKENS = "pdserve.migration.delivered_tokens"  # replayed to the new worker(s)
ATTR_MIGRATION_COUNT = "pdserve.migration.count"  # this request's migrations so far
# On a kv.transfer span (status error) when the pulled KV failed its checksum: never served.
EVENT_KV_CHECKSUM_MISMATCH = "pdserve.kv.checksum_mismatch"

# --- GenAI semantic conventions (request span) ------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" or "text_completion"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # list[str]
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# Latencies in seconds, named after vLLM's request-span attributes.
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"

_lock = threading.Lock()
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider once an exporter is configured
_atexit_registered = False


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _exporter_kind() -> str | None:
    """Which exporter the environment asks for: "otlp", "console" or None (tracing off)."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    # OTEL_TRACES_EXPORTER may list several; we honour the first we support.
    requested = [e.strip().lower() for e in _env("OTEL_TRACES_EXPORTER").split(",") if e.strip()]
    if "none" in requested:
        return None
    if "console" in requested:
        return "console"
    # Asked for by name, OTLP goes to the spec's default endpoint (localhost:4318 or :4317).
    # Otherwise that default is not assumed: no endpoint configured means no exporter, no cost.
    if "otlp" in requested:
        return "otlp"
    if _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return None


def _otlp_exporter() -> Any:
    protocol = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = protocol.lower() or "http/protobuf"
    # The exporters read endpoint, headers, timeout, compression and TLS from the env themselves.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(
        f"unsupported OTLP protocol {protocol!r} (use http/protobuf or grpc) "
        "in OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL"
    )


def setup_tracing(service_name: str, instance_id: str) -> None:
    """Install the SDK tracer provider for this process if the environment asks for export.

    Call once, early, before the first span. ``service_name`` is one of the ``SERVICE_*``
    constants; ``instance_id`` is the worker/gateway id (unique per process).
    """
    global _provider, _atexit_registered
    kind = _exporter_kind()
    if kind is None:
        return  # keep the API's no-op provider: nothing is recorded, nothing is exported
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    with _lock:
        if _provider is not None:
            return
        attrs: dict[str, str] = {SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: instance_id}
        if _env("OTEL_SERVICE_NAME"):
            attrs[SERVICE_NAME] = _env("OTEL_SERVICE_NAME")
        # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES and process/sdk attributes.
        resource = Resource.create(attrs)
        # sampler=None: the SDK reads OTEL_TRACES_SAMPLER / _ARG (default parentbased_always_on).
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        exporter = ConsoleSpanExporter() if kind == "console" else _otlp_exporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _provider = provider
        if not _atexit_registered:
            atexit.register(shutdown_tracing)
            _atexit_registered = True


def tracing_enabled() -> bool:
    """True when spans are recorded and exported (callers may skip costly attribute work)."""
    return _provider is not None


def shutdown_tracing(timeout_millis: int = 5000) -> None:
    """Export every finished span, then stop the exporter. Safe to call more than once."""
    global _provider
    with _lock:
        provider, _provider = _provider, None
    if provider is None:
        return
    provider.force_flush(timeout_millis)
    provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    """A tracer for ``name`` (use the module's ``__name__``); safe to create before setup."""
    return trace.get_tracer(name)


def inject_headers(
    headers: dict[str, str] | None = None, context: Context | None = None
) -> dict[str, str]:
    """Write the W3C ``traceparent`` (and ``tracestate``) of ``context`` into NATS headers.

    ``context`` defaults to the current one; pass ``trace.set_span_in_context(root)`` to parent
    the next hop on a specific span. Returns the headers dict (a new one if None was given).
    """
    headers = {} if headers is None else headers
    propagate.inject(headers, context=context)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by incoming NATS or HTTP headers (empty context if none).

    Header names are matched case-insensitively: HTTP clients may send ``Traceparent`` and
    NATS keeps whatever case the sender used, while the propagator looks up ``traceparent``.
    """
    return propagate.extract({k.lower(): v for k, v in headers.items()} if headers else {})


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    context: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    tracer_name: str = "pdserve",
    events: Sequence[tuple[str, Mapping[str, Any]]] = (),
    error: str | None = None,
) -> trace.Span:
    """Record a finished span whose times were measured already (``time.time_ns()`` values).

    Engine steps serve many requests at once; after a step, the worker records one span per
    request under that request's extracted context, sharing the step's start and end.
    ``events`` (name, attributes) are stamped at its end; ``error`` sets its status to ERROR.
    """
    span = trace.get_tracer(tracer_name).start_span(
        name, context=context, start_time=start_ns, attributes=dict(attributes or {})
    )
    for event, event_attributes in events:
        span.add_event(event, dict(event_attributes), timestamp=end_ns)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)
    return span


def kv_transfer_attributes(
    client_id: str, num_bytes: int, num_blocks: int, seconds: float, transport: str
) -> dict[str, Any]:
    """The ``kv.transfer`` span attributes, with GB/s computed the same way everywhere."""
    gbps = num_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return {
        ATTR_REQUEST_ID: client_id,
        ATTR_KV_BYTES: int(num_bytes),
        ATTR_KV_BLOCKS: int(num_blocks),
        ATTR_KV_SECONDS: float(seconds),
        ATTR_KV_GBPS: float(gbps),
        ATTR_KV_TRANSPORT: transport,
    }


def roofline_attributes(r: Roofline | None) -> dict[str, Any]:
    """A roofline's span attributes (none without one: no peaks, or no forward pass)."""
    if r is None:
        return {}
    return {
        ATTR_ROOFLINE_INTENSITY: float(r.intensity),
        ATTR_ROOFLINE_COMPUTE_FRACTION: float(r.compute_fraction),
        ATTR_ROOFLINE_BANDWIDTH_FRACTION: float(r.bandwidth_fraction),
        ATTR_ROOFLINE_BOUND: r.bound,
    }
