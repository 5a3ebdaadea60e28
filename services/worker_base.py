"""What prefill and decode workers share: the hooks a role fills in, and a worker's life around
an engine that ``EngineThread`` steps in its own thread.

The loop never touches engine state: it posts commands (``engine.add_request``, ``abort``...)
and reads ``engine.stats()``; each step's result comes back through ``on_step``.

A worker's life: load the model -> connect -> subscribe -> heartbeat (routable) -> serve ->
SIGTERM: draining (heartbeats say so, new requests are refused with a retryable error) -> wait
until in-flight work is done or ``drain_seconds`` pass -> ``WorkerGone`` -> exit. Its metrics port
(up before the model loads) reports each phase on ``/ready`` and ``/live`` (telemetry/health.py).

The rest is in parts of their own, each holding a reference to the worker: ``worker_report.py``
(heartbeat load, metrics), ``bus_presence.py`` (heartbeats, KV events, cancels, admin, the
reconnect notice), ``request_watch.py`` (deadlines, a dead engine), ``recent_cancels.py`` and
``background_tasks.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import time

from prometheus_client import CollectorRegistry

from pdserve.services import standby
from pdserve.services.background_tasks import BackgroundTasks
from pdserve.services.bus_presence import BusPresence
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.engine_thread import EngineThread
from pdserve.services.engine.outputs import StepResult
from pdserve.services.engine.parallel.kv_link import RankLink
from pdserve.services.rank_endpoints import rank_table, start_other_ranks
from pdserve.services.recent_cancels import RecentCancels
from pdserve.services.request_state import RequestState, record_queue
from pdserve.services.request_watch import RequestWatch
from pdserve.services.worker_process import default_worker_id, set_torch_threads
from pdserve.services.worker_report import WorkerReport
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.rejects import BusRejectCollector
from pdserve.shared.config import BusConfig, EngineConfig, WorkerConfig
from pdserve.shared.options import build
from pdserve.shared.telemetry import health, tracing
from pdserve.shared.telemetry.kv_tier_metrics import KVTierCollector
from pdserve.shared.telemetry.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Worker:
    """Base of the prefill and decode workers (subclasses: ``role``, handlers, ``on_step``)."""

    role = "worker"
    service_name = "pdserve-worker"

    def __init__(self, ns: argparse.Namespace | dict, bus: Bus | None = None) -> None:
        self.config = build(WorkerConfig, ns)
        self.engine_config = build(EngineConfig, ns)
        self.bus_config = build(BusConfig, ns)
        self.worker_id = self.config.worker_id or default_worker_id(self.role)
        self.instance = secrets.token_hex(8)
        self.metrics_registry = CollectorRegistry()  # Prometheus', not the worker registry
        self.metrics = WorkerMetrics(self.metrics_registry, self.role)
        tiers = KVTierCollector(self.role, lambda: self.engine and self.engine.offload.stats())
        self.metrics_registry.register(tiers)  # the KV offload tiers, read at scrape time
        self.engine: LLMEngine | None = None
        self.engine_thread: EngineThread | None = None
        self.bus = bus if bus is not None else Bus(self.bus_config, self.worker_id)
        self.subjects = self.bus.subjects
        self.metrics_registry.register(BusRejectCollector(lambda: self.bus.stats.rejected_by))
        self.health = health.Health(
            work_counts=self.work_counts, connected=lambda: self.bus.connected
        )
        self.states: dict[str, RequestState] = {}
        self.draining = False
        self.standby = standby.arm(self)  # services/standby.py: not routed until promoted
        self.stopping = asyncio.Event()  # set: serve() stops waiting and drains
        self.tasks = BackgroundTasks()
        self.recent_cancels = RecentCancels()  # cancels that may overtake their request
        self.report = WorkerReport(self)  # heartbeat load, metrics; serves /ready and /live
        self.presence = BusPresence(self, self.report.load)
        self.watch = RequestWatch(self)
        self._housekeeping: asyncio.Task | None = None
        self.rank_link: RankLink | None = None  # TP > 1: the other ranks' KV endpoints
        # TP > 1: every rank's pid and UCX transports, by rank (the doctor's probes report them)
        self.tp_ranks: list[dict] = []

    # -- hooks for subclasses -----------------------------------------------------------------

    def make_engine(self) -> LLMEngine:
        return LLMEngine(self.engine_config)

    async def subscribe(self) -> None:
        raise NotImplementedError

    def on_step(self, step: StepResult) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        """True while drain must wait (requests in flight, leases held...)."""
        return bool(self.states)

    def load_extra(self) -> dict:
        return {}

    def work_counts(self) -> dict[str, int]:
        """What a drain waits for, as /ready shows it."""
        return {"requests": len(self.states)}

    async def housekeeping(self) -> None:
        """Periodic checks beyond deadlines (lease expiry...)."""

    async def on_cancel(self, bus_id: str) -> None:
        raise NotImplementedError

    async def on_cancel_choice(self, bus_id: str, index: int) -> None:
        """Stop one choice of a request with several (only decode workers generate them)."""

    async def fail(self, state: RequestState, code: str, text: str) -> None:
        """End a request here with an explicit error to its gateway (deadline, dead engine)."""
        raise NotImplementedError

    async def start_extra(self) -> None:
        """Start subclass services before subscriptions (UCX listener...)."""

    async def close_extra(self) -> None:
        """Release subclass resources (UCX listener...)."""

    # -- for subclasses -----------------------------------------------------------------------

    async def start_rank_link(self) -> list[dict]:
        """TP > 1: start the other ranks' KV endpoints as ours (rank r on ``--ucx-port`` + r);
        what each reported, by rank from 1. Call it once our own endpoint is up: ``tp_ranks``
        gets each rank's pid and UCX transports, ours included."""
        ranks = self.engine.ranks
        if ranks is None:
            return []
        self.rank_link = RankLink(ranks.kv_conns)
        self.rank_link.start()
        fingerprint = self.engine.layout_fingerprint()
        others = await start_other_ranks(
            self.rank_link, ranks.size, self.role, fingerprint, self.config
        )
        self.tp_ranks = rank_table(others)
        return others

    def mark_scheduled(self, state: RequestState, queue_span: str, start_ns: int) -> None:
        """The request's first engine step: it ends its queue span and its queue-time sample."""
        seconds = record_queue(state, self.worker_id, queue_span, start_ns)
        if seconds is not None:
            self.metrics.queue_time.observe(seconds)

    # -- a worker's life ----------------------------------------------------------------------

    def run(self) -> int:
        logging.basicConfig(
            level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
            format=f"%(asctime)s %(levelname)s {self.worker_id} %(name)s: %(message)s",
        )
        tracing.setup_tracing(self.service_name, self.worker_id)
        try:
            self.report.serve_metrics()  # /live and /ready answer while a large checkpoint loads
            threads = set_torch_threads(self.engine_config.torch_threads)
            self.engine = self.make_engine()
            engine = self.engine
            log.info(
                "%s worker %s: model %s, %d KV blocks of %d tokens on %s, %s torch threads",
                self.role,
                self.worker_id,
                engine.model_name,
                engine.num_blocks,
                engine.block_size,
                engine.device,
                threads,
            )
            self.metrics.roofline.load_peaks(engine.device, engine.dtype, threads)  # cached or now
            asyncio.run(self.serve())
        finally:
            tracing.shutdown_tracing()
        return 1 if self.engine_thread is not None and self.engine_thread.error else 0

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        standby.install(self, loop)
        await self.start()
        await self.stopping.wait()
        await self.drain_and_close()

    async def start(self) -> None:
        """Connect, start the engine thread, subscribe and announce this worker."""
        self.report.serve_metrics()
        self.health.enter(health.JOINING)
        await self.bus.connect()
        # the feed first: the engine thread hands it every change of the prefix cache
        feed = self.engine.kv_event_feed() if self.engine_config.prefix_cache else None
        self.engine_thread = EngineThread(
            self.engine, asyncio.get_running_loop(), self._on_step_safe
        )
        self.engine_thread.start()
        await self.start_extra()
        await self.subscribe()
        await self.presence.start(feed)
        self._housekeeping = self.tasks.spawn(self.watch.run())
        if not self.draining:  # a SIGTERM during start-up stays a drain
            self.health.enter(health.READY)
        log.info("%s worker %s ready", self.role, self.worker_id)

    def _on_step_safe(self, step: StepResult) -> None:
        try:  # the step's roofline first: on_step's spans carry it
            step.stats.roofline = self.metrics.roofline.step(step.stats)
            self.on_step(step)
        except Exception:
            log.exception("handling engine outputs failed")

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: no new requests; finishing %d in flight", len(self.states))
            self.draining = True
            self.health.enter(health.DRAINING)
            self.stopping.set()
            self.tasks.spawn(self.presence.publish_load())  # leave the routing tables at once

    async def drain_and_close(self) -> None:
        """Wait for in-flight work (up to ``drain_seconds``), leave the registry, close."""
        self.draining = True
        self.health.enter(health.DRAINING)
        await self.presence.publish_load()
        deadline = time.monotonic() + self.config.drain_seconds
        while self.busy() and time.monotonic() < deadline:
            if self.engine_thread.error is not None:
                break
            await asyncio.sleep(0.05)
        if self.busy():
            log.warning("drain time over with work left; exiting anyway")
        self._housekeeping.cancel()
        await self.presence.stop()
        self.engine_thread.stop()
        await self.close_extra()
        await self.bus.close()
        log.info("%s worker %s stopped", self.role, self.worker_id)
