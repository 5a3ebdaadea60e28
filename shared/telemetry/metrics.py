"""Prometheus metrics of the gateway and the workers (prometheus_client, text format).

Each process builds its metrics on its own ``CollectorRegistry`` (never the global default), so
tests can run several gateways or workers in one interpreter. Times are seconds, sizes bytes.

Gateway::

    registry = CollectorRegistry()
    m = GatewayMetrics(registry)
    registry.register(WorkerLoadCollector(lambda: discovery.loads()))  # one scrape point for `up`
    app.router.add_get("/metrics", metrics_handler(registry))

Worker::

    registry = CollectorRegistry()
    m = WorkerMetrics(registry, role="decode")
    server = start_metrics_server(cfg.metrics_port, registry)
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder
from prometheus_client.registry import Collector

from pdserve.shared.telemetry.buckets import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    KV_TRANSFER_BUCKETS,
    QUEUE_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    TTFT_BUCKETS,
)
from pdserve.shared.telemetry.roofline_metrics import RooflineMetrics, roofline_families


class GatewayMetrics:
    """Request-level metrics as the client sees them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival to the first generated token leaving the gateway.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive tokens of one request (one observation per token).",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request arrival to its last token.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "pdserve_requests",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated for clients.", registry=registry
        )
        self.in_flight = Gauge(
            "pdserve_requests_in_flight",
            "Requests accepted and not yet finished.",
            registry=registry,
        )
        self.prompt_tokens_per_request = Histogram(
            "pdserve_request_prompt_tokens",
            "Prompt length of each request.",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=registry,
        )
        self.generation_tokens_per_request = Histogram(
            "pdserve_request_generation_tokens",
            "Generated tokens of each request.",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=registry,
        )
        self.migrations = Counter(
            "pdserve_request_migrations",
            "Requests moved to another decode worker mid-stream, by reason (worker_lost: its "
            "decode worker left; bus_reconnect: the gateway's NATS connection broke).",
            ["reason"],
            registry=registry,
        )

    def request_finished(
        self, finish_reason: str, prompt_tokens: int, generation_tokens: int, e2e_seconds: float
    ) -> None:
        """Account one finished request (TTFT and ITL are observed as tokens arrive)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.prompt_tokens_per_request.observe(prompt_tokens)
        self.generation_tokens_per_request.observe(generation_tokens)
        self.e2e.observe(e2e_seconds)


class WorkerMetrics:
    """Per-worker engine metrics; every series carries a ``role`` label (prefill or decode)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["role"], buckets=buckets, registry=registry).labels(role)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ["role"], registry=registry).labels(role)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["role"], registry=registry).labels(role)

        self.queue_time = hist(
            "pdserve_worker_queue_time_seconds",
            "Request arrival at the worker to its first scheduled forward pass.",
            QUEUE_BUCKETS,
        )
        self.prefill_time = hist(
            "pdserve_worker_prefill_time_seconds",
            "Time a request spent in prefill forward passes (all its chunks).",
            TTFT_BUCKETS,
        )
        self.decode_step_time = hist(
            "pdserve_worker_decode_step_seconds",
            "Duration of one decode engine step (the whole batch).",
            ITL_BUCKETS,
        )
        self.kv_transfer_seconds = hist(
            "pdserve_kv_transfer_seconds",
            "Duration of one request's KV pull from a prefill worker.",
            KV_TRANSFER_BUCKETS,
        )
        self.kv_transfer_bytes = counter(
            "pdserve_kv_transfer_bytes", "KV-cache bytes pulled from prefill workers."
        )
        self.kv_checksum_failures = counter(
            "pdserve_kv_checksum_failures",
            "KV pulls whose bytes failed their checksum (--kv-checksum); never served.",
        )
        # A drain that loses nothing keeps both at 0 (tests/integration/test_drain.py).
        self.kv_pull_failures = counter(
            "pdserve_kv_pull_failures",
            "KV pulls that failed (peer gone, lease expired, timeout, checksum), by decode worker.",
        )
        self.kv_recomputes = counter(
            "pdserve_kv_recomputes",
            "Prompts prefilled again here because their KV pull failed (--kv-failure-policy "
            "recompute).",
        )
        self.kv_used_blocks = gauge(
            "pdserve_worker_kv_cache_used_blocks", "KV-cache blocks in use (incl. leased)."
        )
        self.kv_total_blocks = gauge("pdserve_worker_kv_cache_total_blocks", "KV-cache blocks.")
        self.running = gauge("pdserve_worker_running_requests", "Sequences in the running batch.")
        self.waiting = gauge("pdserve_worker_waiting_requests", "Requests waiting to be scheduled.")
        self.preemptions = counter(
            "pdserve_worker_preemptions", "Sequences preempted because KV blocks ran out."
        )
        self.late_prompts = counter(
            "pdserve_worker_late_prompts",
            "Prompts that waited past --prompt-deadline-ms and went behind the on-time ones.",
        )
        # hit rate = hits / queries: both count full prompt blocks looked up in the prefix cache
        self.prefix_cache_queries = counter(
            "pdserve_worker_prefix_cache_queries", "Prompt blocks looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "pdserve_worker_prefix_cache_hits", "Prompt blocks found in the prefix cache."
        )
        # Speculative decoding, after vLLM's spec_decode metrics: acceptance rate =
        # accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
        self.spec_drafts = counter(
            "pdserve_worker_spec_decode_num_drafts",
            "Speculative drafts verified (a sequence's draft of one or more tokens).",
        )
        self.spec_draft_tokens = counter(
            "pdserve_worker_spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "pdserve_worker_spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_accepted_per_pos = Counter(
            "pdserve_worker_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0 = the first) was accepted.",
            ["role", "position"],
            registry=registry,
        )
        # which roof each step hit (roofline_metrics.py): FLOPs, bytes, fractions of the peaks
        self.roofline = RooflineMetrics(registry, role)

    def count_spec(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        """Add speculative-decoding counts (increments since the last call)."""
        self.spec_drafts.inc(drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted_tokens.inc(accepted)
        for position, count in enumerate(per_pos):
            if count:
                self.spec_accepted_per_pos.labels(self.role, str(position)).inc(count)

    def set_load(self, used_blocks: int, total_blocks: int, running: int, waiting: int) -> None:
        """Refresh the load gauges (call with each heartbeat or engine step)."""
        self.kv_used_blocks.set(used_blocks)
        self.kv_total_blocks.set(total_blocks)
        self.running.set(running)
        self.waiting.set(waiting)


# WorkerLoad's speculative-decoding totals -> (the gateway's series name, its help)
SPEC_LOAD_COUNTERS = (
    ("spec_drafts", "drafts", "Speculative drafts verified per decode worker."),
    ("spec_draft_tokens", "draft_tokens", "Draft tokens verified per decode worker."),
    ("spec_accepted_tokens", "accepted_tokens", "Draft tokens accepted per decode worker."),
)


class WorkerLoadLike(Protocol):
    """The fields of ``pdserve.shared.bus.discovery_messages.WorkerLoad`` this module reads."""

    worker_id: str
    role: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    draining: bool
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int


class WorkerLoadCollector(Collector):
    """Re-exports the discovery registry's worker loads at scrape time, labelled by worker.

    ``loads`` returns the live registry's current ``WorkerLoad`` values; a worker that left the
    registry disappears from the next scrape instead of leaving a stale gauge behind.
    """

    def __init__(self, loads: Callable[[], Iterable[WorkerLoadLike]]) -> None:
        self._loads = loads

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "role"]
        used = GaugeMetricFamily(
            "pdserve_kv_cache_used_blocks", "KV-cache blocks in use per worker.", labels=labels
        )
        total = GaugeMetricFamily(
            "pdserve_kv_cache_total_blocks", "KV-cache blocks per worker.", labels=labels
        )
        running = GaugeMetricFamily(
            "pdserve_running_requests", "Sequences running per worker.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "pdserve_waiting_requests", "Requests waiting per worker.", labels=labels
        )
        draining = GaugeMetricFamily(
            "pdserve_worker_draining", "1 while the worker drains before exit.", labels=labels
        )
        # speculative decoding on decode workers that run it (totals since the worker started)
        spec = {
            field: CounterMetricFamily(f"pdserve_spec_decode_num_{name}", doc, labels=labels)
            for field, name, doc in SPEC_LOAD_COUNTERS
        }
        loads = list(self._loads())
        for load in loads:
            key = [load.worker_id, load.role]
            used.add_metric(key, load.total_blocks - load.free_blocks)
            total.add_metric(key, load.total_blocks)
            running.add_metric(key, load.running)
            waiting.add_metric(key, load.waiting)
            draining.add_metric(key, 1.0 if load.draining else 0.0)
            if load.spec_drafts:
                for field, family in spec.items():
                    family.add_metric(key, getattr(load, field))
        families = [used, total, running, waiting, draining]
        spec_families = [family for family in spec.values() if family.samples]
        return families + spec_families + roofline_families(loads)

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Declaring no fixed series keeps registration from calling ``loads`` before discovery runs.
        return []


def render_metrics(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The registry in the format the scraper's ``Accept`` header asks for, with its type.

    Prometheus text by default; OpenMetrics when asked (Prometheus asks for it to get exemplars
    and created timestamps). The content type keeps its ``version`` parameter, which Prometheus
    3 needs to pick a parser.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def metrics_handler(registry: CollectorRegistry) -> Callable[[Any], Any]:
    """An aiohttp handler serving ``registry`` (for the gateway's ``/metrics`` route)."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        body, content_type = render_metrics(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handle


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP server (background thread)."""

    port: int
    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


# A probe answers an HTTP status and a JSON body (shared/telemetry/health.py).
Probe = Callable[[], tuple[int, dict]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no log
        pass


def start_metrics_server(
    port: int,
    registry: CollectorRegistry,
    addr: str = "0.0.0.0",
    probes: Mapping[str, Probe] | None = None,
) -> MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread; port 0 picks one.

    ``probes`` adds JSON endpoints beside it (``/ready``, ``/live``), answered in the server's
    thread: a probe must only read state, never wait for the event loop."""
    metrics_app = make_wsgi_app(registry)
    paths = dict(probes or {})

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        probe = paths.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics_app(environ, start_response)
        status, body = probe()
        data = json.dumps(body).encode()
        reason = "OK" if status == 200 else "Service Unavailable"
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        start_response(f"{status} {reason}", headers)
        return [data]

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    server = make_server(addr, port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http")
    thread.start()
    return MetricsServer(port=server.server_port, server=server, thread=thread)
