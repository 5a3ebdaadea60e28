"""What a worker tells the world about itself: its load in every heartbeat (``WorkerLoad``), the
Prometheus metrics that follow its engine's totals, and the HTTP server of ``/metrics``,
``/ready`` and ``/live``.

Apart from ``worker_base.py`` because none of it serves a request: it reads the worker and its
engine, and a role adds to it only through ``Worker.load_extra``.
"""

from __future__ import annotations

import functools
from typing import Protocol

from prometheus_client import CollectorRegistry

from pdserve.services import standby
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.spec.speculator import SpecCounters
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.config import EngineConfig, WorkerConfig
from pdserve.shared.kv import ucx_config
from pdserve.shared.kv.layout import layout_id
from pdserve.shared.telemetry.health import Health
from pdserve.shared.telemetry.metrics import WorkerMetrics, start_metrics_server


class ReportedWorker(Protocol):
    """What the report reads of ``services.worker_base.Worker``."""

    worker_id: str
    role: str
    instance: str
    draining: bool
    standby: bool
    config: WorkerConfig
    engine_config: EngineConfig
    engine: LLMEngine | None
    metrics: WorkerMetrics
    metrics_registry: CollectorRegistry
    health: Health

    def load_extra(self) -> dict: ...


# the engine's running totals (EngineStats fields) and the WorkerMetrics counters they feed
COUNTERS = {
    "preemptions": "preemptions",
    "late_prompts": "late_prompts",
    "prefix_queries": "prefix_cache_queries",
    "prefix_hits": "prefix_cache_hits",
}


class WorkerReport:
    def __init__(self, worker: ReportedWorker) -> None:
        self.worker = worker
        self.metrics_url: str | None = None  # also serves /ready and /live
        # the engine's totals already counted, by EngineStats field (COUNTERS)
        self._counted = dict.fromkeys(COUNTERS, 0)
        self._spec_counted = SpecCounters()  # speculative decoding's totals already counted

    def serve_metrics(self) -> None:
        """Serve /metrics, /ready and /live (once; ``run`` does it before loading the model)."""
        worker = self.worker
        if not worker.config.metrics_port or self.metrics_url is not None:
            return
        # on the worker's own address, like KV transfer
        host = worker.config.ucx_host
        addr = "0.0.0.0" if host in ucx_config.ALL_INTERFACES else host
        server = start_metrics_server(
            worker.config.metrics_port, worker.metrics_registry, addr, worker.health.probes()
        )
        self.metrics_url = f"http://{host}:{server.port}/metrics"

    @functools.cached_property
    def kv_layout(self) -> str:
        """The engine's KV layout name (shared.kv_layout), fixed: every heartbeat reuses it."""
        return layout_id(self._engine().layout_fingerprint())

    def load(self) -> WorkerLoad:
        """The heartbeat: what routers need to know of this worker now."""
        worker = self.worker
        engine = self._engine()
        stats = engine.stats()
        return WorkerLoad(
            worker_id=worker.worker_id,
            role=worker.role,
            model=engine.model_name,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            running=stats.running,
            waiting=stats.waiting,
            draining=worker.draining,
            metrics_url=self.metrics_url,
            block_size=engine.block_size,
            max_queue=worker.config.max_queue,
            instance=worker.instance,
            kv_layout=self.kv_layout,
            lora_adapters=list(engine.lora_names()),
            lora_resident=list(engine.lora.resident_names) if engine.lora is not None else [],
            **worker.metrics.roofline.load_fields(),  # forward-pass totals and peaks
            **engine.offload.load_fields(),  # the KV tiers' measured load costs
            **standby.load_fields(worker),
            **worker.load_extra(),
        )

    def update_metrics(self) -> None:
        """The gauges from the engine's latest stats, the counters by what its totals grew."""
        stats = self._engine().stats()
        m = self.worker.metrics
        m.set_load(stats.used_blocks, stats.total_blocks, stats.running, stats.waiting)
        for field, metric in COUNTERS.items():
            total = getattr(stats, field)
            if total > self._counted[field]:
                getattr(m, metric).inc(total - self._counted[field])
            self._counted[field] = total
        spec = stats.spec  # speculative decoding (a decode engine's; a prefill one never drafts)
        if spec is None or spec.drafts == self._spec_counted.drafts:
            return
        new = spec.since(self._spec_counted)
        m.count_spec(new.drafts, new.draft_tokens, new.accepted_tokens, new.accepted_per_pos)
        self._spec_counted = spec

    def _engine(self) -> LLMEngine:
        engine = self.worker.engine
        assert engine is not None, "reported before run() made the engine"
        return engine
