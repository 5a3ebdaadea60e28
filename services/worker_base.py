"""What prefill and decode workers share: the engine thread, bus wiring, heartbeats, deadlines,
cancellation and the SIGTERM drain.

The engine step is blocking CPU/GPU work, so it runs in one dedicated thread (``EngineThread``)
and hands its outputs to the asyncio loop with ``call_soon_threadsafe``. The loop stays free for
NATS (heartbeats keep flowing during long forwards), UCX transfers and bookkeeping. The engine's
own lock makes ``add_request``/``abort``/``release`` safe from the loop thread.

A worker's life: load the model -> connect -> subscribe -> heartbeat (routable) -> serve ->
SIGTERM: draining (heartbeats say so, new requests are refused with a retryable error) -> wait
until in-flight work is done or ``drain_seconds`` pass -> ``WorkerGone`` -> exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.engine.engine import LLMEngine, StepOutput, StepStats
from shared import tracing, ucx_config
from shared.announce import HeartbeatPublisher, KVEventPublisher, register_micro_service
from shared.bus import Bus
from shared.config import BusConfig, EngineConfig, WorkerConfig, build
from shared.metrics import WorkerMetrics, start_metrics_server
from shared.protocol import Cancel, WorkerLoad

log = logging.getLogger("pdserve.worker")

IDLE_WAIT = 0.05  # engine thread sleep when there is nothing to schedule (woken early on work)
HOUSEKEEPING_SECONDS = 0.25  # deadline and lease checks
# How long a cancel is remembered for a request not seen yet. The overtaking race takes
# milliseconds; a short memory keeps a client that reuses its x-request-id for a retry safe.
CANCEL_MEMORY_SECONDS = 2.0
CANCEL_MEMORY = 100_000


def default_worker_id(role: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{role}-{host}-{os.getpid()}"


@dataclass
class Step:
    """One engine step's results, as handed to the event loop."""

    outputs: list[StepOutput]
    stats: StepStats
    start_ns: int  # wall clock, for spans
    end_ns: int


class EngineThread:
    """Steps the engine whenever it has work; delivers each step's outputs to the loop."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[Step], None],
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """New work or freed blocks: step now instead of after the idle wait."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                if not engine.has_unfinished():
                    self._wake.wait(IDLE_WAIT)
                    self._wake.clear()
                    continue
                before = engine.last_step
                start_ns = time.time_ns()
                outputs = engine.step()
                end_ns = time.time_ns()
                if engine.last_step is before:
                    # nothing could be scheduled (e.g. every block is leased): wait for a release
                    self._wake.wait(IDLE_WAIT)
                    self._wake.clear()
                    continue
                step = Step(outputs, engine.last_step, start_ns, end_ns)
                self.loop.call_soon_threadsafe(self.on_step, step)
        except BaseException as exc:  # a dead engine thread must take the worker down loudly
            log.exception("engine thread crashed")
            self.error = exc
            self.loop.call_soon_threadsafe(lambda: None)


@dataclass
class RequestState:
    """What a worker remembers about a request while it is in its engine."""

    request_id: str
    reply_to: str
    deadline: float
    context: object  # OTel context extracted from the message headers
    arrival_ns: int = field(default_factory=time.time_ns)
    first_scheduled_ns: int | None = None
    num_prompt_tokens: int = 0
    client_request_id: str | None = None  # the client's x-request-id, if the gateway sent it

    @property
    def public_id(self) -> str:
        """The id spans carry: the one clients and operators know (their x-request-id)."""
        return self.client_request_id or self.request_id


class Worker:
    """Base of the prefill and decode workers (subclasses: ``role``, handlers, ``on_step``)."""

    role = "worker"
    service_name = "pdserve-worker"

    def __init__(self, ns: argparse.Namespace | dict) -> None:
        self.config = build(WorkerConfig, ns)
        self.engine_config = build(EngineConfig, ns)
        self.bus_config = build(BusConfig, ns)
        self.worker_id = self.config.worker_id or default_worker_id(self.role)
        self.instance = secrets.token_hex(8)
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, self.role)
        self.engine: LLMEngine | None = None
        self.bus = Bus(self.bus_config, self.worker_id)
        self.subjects = self.bus.subjects
        self.states: dict[str, RequestState] = {}
        self.draining = False
        self.metrics_url: str | None = None
        self._stop = asyncio.Event()
        self._engine_thread: EngineThread | None = None
        self._heartbeat: HeartbeatPublisher | None = None
        self._kv_events: KVEventPublisher | None = None
        self._tasks: set[asyncio.Task] = set()
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)  # block manager's (queries, hits) already counted
        self._recent_cancels: dict[str, float] = {}  # request id -> when (insertion ordered)

    # -- hooks for subclasses -----------------------------------------------------------------

    def make_engine(self) -> LLMEngine:
        return LLMEngine(self.engine_config)

    async def subscribe(self) -> None:
        raise NotImplementedError

    def on_step(self, step: Step) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        """True while drain must wait (requests in flight, leases held...)."""
        return bool(self.states)

    def load_extra(self) -> dict:
        return {}

    async def housekeeping(self) -> None:
        """Periodic checks beyond deadlines (lease expiry...)."""

    async def on_cancel(self, request_id: str) -> None:
        raise NotImplementedError

    async def fail(self, state: RequestState, code: str, text: str) -> None:
        """End a request here with an explicit error to its gateway (deadline, dead engine)."""
        raise NotImplementedError

    async def close_extra(self) -> None:
        """Release subclass resources (UCX listener...)."""

    # -- shared machinery ---------------------------------------------------------------------

    def mark_scheduled(self, state: RequestState, queue_span: str, start_ns: int) -> None:
        """The request's first engine step: it ends its queue span and its queue-time sample."""
        if state.first_scheduled_ns is not None:
            return
        state.first_scheduled_ns = start_ns
        self.metrics.queue_time.observe((start_ns - state.arrival_ns) / 1e9)
        tracing.record_span(
            queue_span,
            state.arrival_ns,
            start_ns,
            context=state.context,
            attributes={
                tracing.ATTR_REQUEST_ID: state.public_id,
                tracing.ATTR_WORKER_ID: self.worker_id,
            },
        )

    def load(self) -> WorkerLoad:
        engine = self.engine
        bm = engine.block_manager
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            model=engine.model_name,
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            running=engine.num_running,
            waiting=engine.num_waiting,
            draining=self.draining,
            metrics_url=self.metrics_url,
            block_size=engine.block_size,
            max_queue=self.config.max_queue,
            instance=self.instance,
            **self.load_extra(),
        )

    def wake_engine(self) -> None:
        if self._engine_thread is not None:
            self._engine_thread.wake()

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

    def update_metrics(self, stats: StepStats | None = None) -> None:
        engine = self.engine
        bm = engine.block_manager
        self.metrics.set_load(
            bm.num_used_blocks, bm.num_blocks, engine.num_running, engine.num_waiting
        )
        preemptions = engine.scheduler.num_preemptions
        if preemptions > self._preemptions_seen:
            self.metrics.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        queries, hits = bm.prefix_queries, bm.prefix_hits
        if (queries, hits) != self._prefix_seen:
            self.metrics.prefix_cache_queries.inc(queries - self._prefix_seen[0])
            self.metrics.prefix_cache_hits.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)

    def reply_ok(self, reply_to: str) -> bool:
        """Replies go only to gateway inboxes: a message cannot make us publish elsewhere."""
        return reply_to.startswith(self.subjects.gateway_prefix)

    async def _on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        # Cancels and requests travel on different subscriptions, so a cancel can overtake the
        # request it cancels: remember it for a while and drop that request when it arrives.
        now = time.monotonic()
        self._recent_cancels[msg.request_id] = now
        while self._recent_cancels:
            rid, at = next(iter(self._recent_cancels.items()))
            if now - at < CANCEL_MEMORY_SECONDS and len(self._recent_cancels) <= CANCEL_MEMORY:
                break
            del self._recent_cancels[rid]
        await self.on_cancel(msg.request_id)

    def was_cancelled(self, request_id: str) -> bool:
        at = self._recent_cancels.get(request_id)
        return at is not None and time.monotonic() - at < CANCEL_MEMORY_SECONDS

    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            if self._engine_thread is not None and self._engine_thread.error is not None:
                log.error("engine thread died; failing %d requests and stopping", len(self.states))
                error = f"the {self.role} worker's engine failed: {self._engine_thread.error!r}"
                for state in list(self.states.values()):
                    await self.fail(state, "internal", error[:500])
                self._stop.set()
                return
            now = time.time()
            for state in [s for s in self.states.values() if s.deadline < now]:
                if self.states.get(state.request_id) is state:
                    log.warning("request %s passed its deadline", state.request_id)
                    await self.fail(
                        state, "deadline", f"request deadline passed during {self.role}"
                    )
            await self.housekeeping()
            self.update_metrics()

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: no new requests; finishing %d in flight", len(self.states))
            self.draining = True
            self._stop.set()
            if self._heartbeat is not None:
                self.spawn(self._heartbeat.publish_now())  # leave the routing tables at once

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        await self.bus.connect()
        self._engine_thread = EngineThread(self.engine, loop, self._on_step_safe)
        self._engine_thread.start()
        await self.start_extra()
        await self.subscribe()
        await self.bus.subscribe(self.subjects.cancel, self._on_cancel, (Cancel,))
        if self.config.metrics_port:
            # on the worker's own address, like KV transfer
            host = self.config.ucx_host
            addr = "0.0.0.0" if host in ucx_config.ALL_INTERFACES else host
            server = start_metrics_server(self.config.metrics_port, self.registry, addr=addr)
            self.metrics_url = f"http://{self.config.ucx_host}:{server.port}/metrics"
        self._heartbeat = HeartbeatPublisher(self.bus, self.load, self.config.heartbeat_seconds)
        await self._heartbeat.start()
        if self.engine.block_manager.enable_prefix_cache:
            # What this worker's prefix cache holds, for the gateway's KV-aware routing.
            self._kv_events = KVEventPublisher(
                self.bus,
                self.worker_id,
                self.instance,
                self.engine.block_size,
                self.engine.drain_kv_events,
                self.engine.drain_kv_snapshot,
                self.config.heartbeat_seconds,
            )
            await self._kv_events.start()
        micro = None
        with contextlib.suppress(Exception):  # optional: visibility for NATS tooling
            micro = await register_micro_service(self.bus, self.load)
        housekeeping = self.spawn(self._housekeeping_loop())
        log.info("%s worker %s ready", self.role, self.worker_id)

        await self._stop.wait()
        self.draining = True
        await self._heartbeat.publish_now()
        deadline = time.monotonic() + self.config.drain_seconds
        while self.busy() and time.monotonic() < deadline:
            if self._engine_thread.error is not None:
                break
            await asyncio.sleep(0.05)
        if self.busy():
            log.warning("drain time over with work left; exiting anyway")
        housekeeping.cancel()
        if self._kv_events is not None:
            await self._kv_events.stop()
        await self._heartbeat.stop(gone=True)
        if micro is not None:
            with contextlib.suppress(Exception):
                await micro.stop()
        self._engine_thread.stop()
        await self.close_extra()
        await self.bus.close()
        log.info("%s worker %s stopped", self.role, self.worker_id)

    async def start_extra(self) -> None:
        """Start subclass services before subscriptions (UCX listener...)."""

    def _on_step_safe(self, step: Step) -> None:
        try:
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
            threads = set_torch_threads(self.engine_config.torch_threads)
            self.engine = self.make_engine()
            log.info(
                "%s worker %s: model %s, %d KV blocks of %d tokens on %s, %s torch threads",
                self.role,
                self.worker_id,
                self.engine.model_name,
                self.engine.block_manager.num_blocks,
                self.engine.block_size,
                self.engine.device,
                threads,
            )
            asyncio.run(self.serve())
        finally:
            tracing.shutdown_tracing()
        return 1 if self._engine_thread is not None and self._engine_thread.error else 0


def set_torch_threads(requested: int) -> int:
    """Size torch's CPU thread pool: ``requested``, else ``OMP_NUM_THREADS`` if set, else one
    thread per CPU this process may run on. Its affinity, not the machine's CPU count: ``pdserve
    up`` gives each worker its own CPUs, and two workers each running a thread per machine CPU
    on the same cores only preempt each other mid-GEMM."""
    import torch

    if requested > 0:
        torch.set_num_threads(requested)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def exit_now(rc: int) -> None:
    """Leave without interpreter teardown.

    Everything that matters is already flushed (bus, spans, logs); tearing down torch's and
    UCX's native state takes seconds, which every drain, ``pdserve up`` shutdown and test
    would otherwise wait for.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def record_prefill_forward(
    worker: Worker, state: RequestState, rid: str, step: Step, finished: dict[str, int], **extra
) -> None:
    """The ``prefill.forward`` span of one sequence in a step, on either kind of worker."""
    seq = worker.engine.seqs.get(rid)
    tracing.record_span(
        tracing.SPAN_PREFILL_FORWARD,
        step.start_ns,
        step.end_ns,
        context=state.context,
        attributes={
            tracing.ATTR_REQUEST_ID: state.public_id,
            tracing.ATTR_WORKER_ID: worker.worker_id,
            tracing.ATTR_BATCH_SIZE: step.stats.num_seqs,
            tracing.ATTR_BATCH_TOKENS: step.stats.num_tokens,
            # a sequence that finished in this step is gone from the engine: its output says
            tracing.ATTR_CACHED_TOKENS: seq.num_cached_tokens if seq else finished.get(rid, 0),
            **extra,
        },
    )
