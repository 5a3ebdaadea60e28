"""What prefill and decode workers share: bus wiring, heartbeats, deadlines, cancellation and the
SIGTERM drain around an engine that ``EngineThread`` steps in its own thread.

The loop never touches engine state: it posts commands (``engine.add_request``, ``abort``...)
and reads ``engine.stats()``; each step's result comes back through ``on_step``.

A worker's life: load the model -> connect -> subscribe -> heartbeat (routable) -> serve ->
SIGTERM: draining (heartbeats say so, new requests are refused with a retryable error) -> wait
until in-flight work is done or ``drain_seconds`` pass -> ``WorkerGone`` -> exit. Its metrics port
(up before the model loads) reports each phase on ``/ready`` and ``/live`` (telemetry/health.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import time

from prometheus_client import CollectorRegistry

from pdserve.services import standby
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.engine_thread import EngineThread
from pdserve.services.engine.outputs import StepResult
from pdserve.services.engine.parallel.kv_link import RankLink
from pdserve.services.kv_event_streams import KVEventStreams, kv_event_streams
from pdserve.services.rank_endpoints import rank_table, start_other_ranks
from pdserve.services.request_state import RequestState, record_queue
from pdserve.services.worker_process import default_worker_id, set_torch_threads
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.bus.request_messages import Cancel
from pdserve.shared.config import BusConfig, EngineConfig, WorkerConfig
from pdserve.shared.discovery.announce import HeartbeatPublisher, register_micro_service
from pdserve.shared.discovery.cache_reset import answer_resets
from pdserve.shared.kv import ucx_config
from pdserve.shared.kv.layout import layout_id
from pdserve.shared.options import build
from pdserve.shared.telemetry import health, tracing
from pdserve.shared.telemetry.kv_tier_metrics import KVTierCollector
from pdserve.shared.telemetry.metrics import WorkerMetrics, start_metrics_server

log = logging.getLogger("pdserve.worker")

HOUSEKEEPING_SECONDS = 0.25  # deadline and lease checks
# How long a cancel is remembered for a request not seen yet. The overtaking race takes
# milliseconds; a short memory keeps a client that reuses its x-request-id for a retry safe.
CANCEL_MEMORY_SECONDS = 2.0
CANCEL_MEMORY = 100_000


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
        self.bus = bus if bus is not None else Bus(self.bus_config, self.worker_id)
        self.subjects = self.bus.subjects
        self.health = health.Health(self.work_counts, lambda: self.bus.connected)
        self.states: dict[str, RequestState] = {}
        self.draining = False
        self.standby = standby.arm(self)  # services/standby.py: not routed until promoted
        self.metrics_url: str | None = None  # also serves /ready and /live
        self._stop = asyncio.Event()
        self._engine_thread: EngineThread | None = None
        self._heartbeat: HeartbeatPublisher | None = None
        self._kv_events: KVEventStreams | None = None
        self._micro: object | None = None
        self._housekeeping: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._counted = (0, 0, 0)  # engine's (preemptions, prefix queries, hits) already counted
        self._recent_cancels: dict[str, float] = {}  # request id -> when (insertion ordered)
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

    async def _reset_prefix_cache(self, external: bool) -> tuple[int, int] | None:
        """``POST /reset_prefix_cache``: the cached blocks forgotten, the pool's and (external)
        the tiers' (None: busy)."""
        return await asyncio.wrap_future(self.engine.reset_prefix_cache(external))

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

    # -- shared machinery ---------------------------------------------------------------------

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

    @functools.cached_property
    def kv_layout(self) -> str:
        """The engine's KV layout name (shared.kv_layout), fixed: every heartbeat reuses it."""
        return layout_id(self.engine.layout_fingerprint())

    def load(self) -> WorkerLoad:
        engine = self.engine
        stats = engine.stats()
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            model=engine.model_name,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            running=stats.running,
            waiting=stats.waiting,
            draining=self.draining,
            metrics_url=self.metrics_url,
            block_size=engine.block_size,
            max_queue=self.config.max_queue,
            instance=self.instance,
            kv_layout=self.kv_layout,
            **self.metrics.roofline.load_fields(),  # forward-pass totals and peaks
            **engine.offload.load_fields(),  # the KV tiers' measured load costs
            **standby.load_fields(self),
            **self.load_extra(),
        )

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, keeping a reference and logging failures."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def update_metrics(self) -> None:
        stats = self.engine.stats()
        m = self.metrics
        m.set_load(stats.used_blocks, stats.total_blocks, stats.running, stats.waiting)
        preemptions, queries, hits = self._counted
        if stats.preemptions > preemptions:
            m.preemptions.inc(stats.preemptions - preemptions)
        if stats.prefix_queries > queries:
            m.prefix_cache_queries.inc(stats.prefix_queries - queries)
        if stats.prefix_hits > hits:
            m.prefix_cache_hits.inc(stats.prefix_hits - hits)
        self._counted = (stats.preemptions, stats.prefix_queries, stats.prefix_hits)

    def reply_ok(self, reply_to: str) -> bool:
        """Replies go only to gateway inboxes: a message cannot make us publish elsewhere."""
        return reply_to.startswith(self.subjects.gateway_prefix)

    async def _on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        if msg.index is not None:
            await self.on_cancel_choice(msg.bus_id, msg.index)
            return
        # Cancels and requests travel on different subscriptions, so a cancel can overtake the
        # request it cancels: remember it for a while and drop that request when it arrives.
        now = time.monotonic()
        self._recent_cancels[msg.bus_id] = now
        while self._recent_cancels:
            rid, at = next(iter(self._recent_cancels.items()))
            if now - at < CANCEL_MEMORY_SECONDS and len(self._recent_cancels) <= CANCEL_MEMORY:
                break
            del self._recent_cancels[rid]
        await self.on_cancel(msg.bus_id)

    def was_cancelled(self, bus_id: str) -> bool:
        at = self._recent_cancels.get(bus_id)
        return at is not None and time.monotonic() - at < CANCEL_MEMORY_SECONDS

    async def check_requests(self) -> bool:
        """Deadlines (of requests without a first token yet: queued, pulling, prefilling), a
        dead engine thread, subclass housekeeping. False: the worker must stop."""
        if self._engine_thread is not None and self._engine_thread.error is not None:
            lost = self.engine.ranks.failure if self.engine.ranks is not None else None
            if lost is not None:  # as if this worker died: gateways migrate its streams
                log.error("%s; leaving with %d requests for others", lost, len(self.states))
                self._stop.set()
                return False
            log.error("engine thread died; failing %d requests and stopping", len(self.states))
            error = f"the {self.role} worker's engine failed: {self._engine_thread.error!r}"
            for state in list(self.states.values()):
                await self.fail(state, "internal", error[:500])
            self._stop.set()
            return False
        now = time.time()
        for state in [s for s in self.states.values() if s.deadline < now and not s.started]:
            if self.states.get(state.bus_id) is state:
                log.warning("request %s passed its deadline", state.bus_id)
                why = f"request deadline passed before its first token ({self.role})"
                await self.fail(state, "deadline", why)
        await self.housekeeping()
        self.update_metrics()
        return True

    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            self.health.tick()
            if not await self.check_requests():
                return

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: no new requests; finishing %d in flight", len(self.states))
            self.draining = True
            self.health.enter(health.DRAINING)
            self._stop.set()
            if self._heartbeat is not None:
                self.spawn(self._heartbeat.publish_now())  # leave the routing tables at once

    def start_metrics(self) -> None:
        """Serve /metrics, /ready and /live (once; ``run`` does it before loading the model)."""
        if not self.config.metrics_port or self.metrics_url is not None:
            return
        # on the worker's own address, like KV transfer
        host = self.config.ucx_host
        addr = "0.0.0.0" if host in ucx_config.ALL_INTERFACES else host
        server = start_metrics_server(
            self.config.metrics_port, self.metrics_registry, addr, self.health.probes()
        )
        self.metrics_url = f"http://{host}:{server.port}/metrics"

    async def start(self) -> None:
        """Connect, start the engine thread, subscribe and announce this worker."""
        self.start_metrics()
        self.health.enter(health.JOINING)
        await self.bus.connect()
        # the feed first: the engine thread hands it every change of the prefix cache
        feed = self.engine.kv_event_feed() if self.engine_config.prefix_cache else None
        self._engine_thread = EngineThread(
            self.engine, asyncio.get_running_loop(), self._on_step_safe
        )
        self._engine_thread.start()
        await self.start_extra()
        await self.subscribe()
        await answer_resets(self.bus, self.worker_id, self._reset_prefix_cache)
        await self.bus.subscribe(self.subjects.cancel, self._on_cancel, (Cancel,))
        self._heartbeat = HeartbeatPublisher(self.bus, self.load, self.config.heartbeat_seconds)
        await self._heartbeat.start()
        self.bus.on_reconnect(self._on_bus_reconnect)
        if feed is not None:
            # what its KV tiers hold, for KV-aware routers: ours (NATS), vLLM's format (ZMQ)
            self._kv_events = kv_event_streams(self, feed)
            await self._kv_events.start()
        with contextlib.suppress(Exception):  # optional: visibility for NATS tooling
            self._micro = await register_micro_service(self.bus, self.load)
        self._housekeeping = self.spawn(self._housekeeping_loop())
        if not self.draining:  # a SIGTERM during start-up stays a drain
            self.health.enter(health.READY)
        log.info("%s worker %s ready", self.role, self.worker_id)

    async def _on_bus_reconnect(self) -> None:
        """Our NATS node went away (a node died, a restart): what we published into the dead
        connection, and what was sent to us while unsubscribed, may be lost. Say so
        (``WorkerGone(rejoining=True)``; we keep our requests): gateways retry their prefills
        here, check their streams (``gateway/legs.py``: those that lost tokens migrate, the
        others go on) and cancel again what they abandoned."""
        log.warning("reconnected to NATS: telling gateways that messages may be lost")
        subject = self.subjects.load(self.role, self.worker_id)
        await self.bus.publish(subject, WorkerGone(self.worker_id, self.role, rejoining=True))
        if self._heartbeat is not None:
            await self._heartbeat.publish_now()

    async def drain_and_close(self) -> None:
        """Wait for in-flight work (up to ``drain_seconds``), leave the registry, close."""
        self.draining = True
        self.health.enter(health.DRAINING)
        await self._heartbeat.publish_now()
        deadline = time.monotonic() + self.config.drain_seconds
        while self.busy() and time.monotonic() < deadline:
            if self._engine_thread.error is not None:
                break
            await asyncio.sleep(0.05)
        if self.busy():
            log.warning("drain time over with work left; exiting anyway")
        self._housekeeping.cancel()
        if self._kv_events is not None:
            await self._kv_events.stop()
        await self._heartbeat.stop(gone=True)
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
        self._engine_thread.stop()
        await self.close_extra()
        await self.bus.close()
        log.info("%s worker %s stopped", self.role, self.worker_id)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        standby.install(self, loop)
        await self.start()
        await self._stop.wait()
        await self.drain_and_close()

    def _on_step_safe(self, step: StepResult) -> None:
        try:  # the step's roofline first: on_step's spans carry it
            step.stats.roofline = self.metrics.roofline.step(step.stats)
            self.on_step(step)
        except Exception:
            log.exception("handling engine outputs failed")

    def run(self) -> int:
        logging.basicConfig(
            level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
            format=f"%(asctime)s %(levelname)s {self.worker_id} %(name)s: %(message)s",
        )
        tracing.setup_tracing(self.service_name, self.worker_id)
        try:
            self.start_metrics()  # /live and /ready answer while a large checkpoint loads
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
        return 1 if self._engine_thread is not None and self._engine_thread.error else 0
