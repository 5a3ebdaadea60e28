"""The gateway's side of a request's life on the bus.

One inbox subscription (``{ns}.gw.{gateway_id}``) receives every ``PrefillResult`` and
``TokenBatch`` for this gateway; each is handed to the waiting request (an ``InFlight``, see
``gateway/inflight.py``) by request id. ``Dispatcher.generate`` drives one request through the
stages of the design:

    route -> PrefillRequest to a prefill worker -> first token (yielded at once)
          -> DecodeRequest with the KV handle to a decode worker -> tokens as they come

(sent as the prompt's last pass starts when its KV streams: ``gateway/streamed_prefill.py``),
or, when no prefill worker is alive or the prompt is short, straight to a decode worker that
prefills locally. Every wait has a deadline; a worker leaving the registry has its requests
retried (prefill) or migrated (decode: ``gateway/inflight.py``) at once; a request that ends
early - client gone, stop string, error - is cancelled on the workers so they free its KV
blocks. The ``Dispatcher`` is the ``DispatchPort`` through which each request sends.

When the gateway's own NATS connection breaks, anything published meanwhile may be lost (NATS
core keeps nothing for a subscriber that is away). After the reconnect every request is told
(``BusReconnected``): prefills in flight are retried, decode legs checked - those that lost
tokens migrate, the others go on (``gateway/legs.py``); a worker whose own connection
broke says so (``REJOINED``), with the same effect on what it serves. Until the workers are
heard again on the new connection - which also means their subscriptions are back - new
messages go only to workers that have been, and a migration waits for one (``recovered``).

Each fact about a request in flight has one owner. ``Dispatcher._pending`` (bus id ->
``InFlight``) is the one routing table: where the inbox delivers, who hears of departures and
reconnects, and what is dropped - and cancelled, unless it finished - when the request ends
(``_tracking``: its one way out; a leg that ends earlier leaves through ``unregister``). The
``InFlight`` owns its progress: its legs (their workers are what it watches) and what its
consumer has. The router keeps only load: what this gateway sent or runs on each worker, and
per bus id where that was counted, to take it off there (``prefill_done``, called by the
request's prefill attempt; ``decode_done``, by ``unregister``). ``state.InFlightRequests`` admits
HTTP requests by the client's x-request-id; one may be several on the bus (a prompt array).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from opentelemetry.context import Context

from pdserve.gateway.abandoned import AbandonedLegs
from pdserve.gateway.inflight import InFlight
from pdserve.gateway.inflight_types import (
    DEFAULT_MAX_MIGRATIONS,
    BusReconnected,
    Limits,
    NotSendable,
    NoWorker,
    OpenChoices,
    StageTimeout,
    TokenEvent,
    WorkerFailure,
    WorkerLeft,
    WorkerRejoined,
)
from pdserve.gateway.legs import new_bus_id, with_fixed_seed
from pdserve.gateway.router import Router
from pdserve.shared.bus import protocol
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.lease_messages import ReleaseLease
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import StreamCheck, TokenBatch, TokenItem
from pdserve.shared.discovery.worker_registry import JOINED, LEFT, REJOINED, WorkerRegistry
from pdserve.shared.sampling import SamplingParams
from pdserve.shared.telemetry.tracing import ATTR_REQUEST_ID, SPAN_ROUTE, inject_headers, tracer

log = logging.getLogger("pdserve.gateway.dispatch")
_tracer = tracer(__name__)

# After a reconnect of our bus, how long (in registry timeouts) workers not heard since are
# skipped and a migration waits for a decode worker to be heard: past it, the registry knows.
RECOVERY_TIMEOUTS = 2.0
RECOVERY_POLL_SECONDS = 0.1  # only while recovering: how often the registry is looked at


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        workers: WorkerRegistry,
        router: Router,
        gateway_id: str,
        request_timeout: float,
        prefill_timeout: float,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        migrations: Any = None,  # a prometheus Counter labelled by reason, or None
        *,
        first_token_timeout: float,
        stall_timeout: float,
    ) -> None:
        self.bus = bus
        self.workers = workers
        self.router = router
        self.inbox = bus.subjects.gateway(gateway_id)
        # seconds, 0 = no limit (request: a total cap; see gateway/inflight.py)
        self.request_timeout = request_timeout
        self.prefill_timeout = prefill_timeout
        self.first_token_timeout = first_token_timeout
        self.stall_timeout = stall_timeout
        self.max_migrations = max_migrations
        self._migrations = migrations
        self._pending: dict[str, InFlight] = {}  # bus id -> request
        self._background: set[asyncio.Task] = set()
        # bus id -> (decode worker, deadline) of legs migrated away from that worker
        self._abandoned = AbandonedLegs()
        self.bus_epoch = 0  # reconnects of our bus so far
        self._reconnected: tuple[float, float] | None = None  # (time.time(), registry clock)
        workers.add_listener(self._on_registry_event)
        bus.on_reconnect(self._on_reconnect)

    async def start(self) -> None:
        await self.bus.subscribe(self.inbox, self._on_message, (PrefillResult, TokenBatch))

    # -- incoming ----------------------------------------------------------------------------

    async def _on_message(self, msg: PrefillResult | TokenBatch, headers: dict[str, str]) -> None:
        for item in [msg] if isinstance(msg, PrefillResult) else msg.items:
            self._deliver(item.bus_id, item)

    def _deliver(self, bus_id: str, item: PrefillResult | TokenItem) -> None:
        request = self._pending.get(bus_id)
        if request is not None:
            request.put(item)
        elif isinstance(item, PrefillResult) and item.kv is not None:
            self.spawn(self.release_stale(item))  # ended already: free its blocks now

    def _on_registry_event(self, event: str, load: WorkerLoad) -> None:
        # LEFT means gone for sure: a clean WorkerGone, a restart, or missed heartbeats that a
        # ping confirmed (a slow but live worker answers it and keeps its requests).
        if event == LEFT:
            for request in self._requests():
                if load.worker_id in request.watching:
                    request.put(WorkerLeft(load.worker_id))
        elif event == JOINED:
            # back after a partition? Cancels sent while it was away never reached it.
            self._cancel_abandoned(load.worker_id)
        elif event == REJOINED:  # its connection broke: what it was sent or sent may be lost
            self._cancel_abandoned(load.worker_id)
            for request in self._requests():
                if load.worker_id in request.watching:
                    request.put(WorkerRejoined(load.worker_id))

    def _requests(self) -> list[InFlight]:
        return list(dict.fromkeys(self._pending.values()))  # a request may have several ids

    async def _on_reconnect(self) -> None:
        self.bus_epoch += 1
        self._reconnected = (time.time(), self.workers.clock())
        log.warning("bus reconnected: %d request(s) check what may be lost", len(self._pending))
        for request in self._requests():
            request.put(BusReconnected(self.bus_epoch))
        self.spawn(self._cancel_abandoned_when_heard())

    # -- our bus connection recovering ---------------------------------------------------------

    def _recovery_over(self) -> bool:
        if self._reconnected is None:
            return True
        if time.time() - self._reconnected[0] > RECOVERY_TIMEOUTS * self.workers.timeout:
            self._reconnected = None
            return True
        return False

    def _unheard(self) -> set[str]:
        """Workers not heard since our last reconnect (their subscriptions may not be back)."""
        if self._recovery_over():
            return set()
        since = self._reconnected[1]
        return {w for w, entry in self.workers.entries.items() if entry.last_seen <= since}

    async def recovered(self, deadline: float) -> set[str]:
        """The workers to skip now: none, unless our bus connection broke lately. While it is
        down, wait for it; once it is back, wait (up to the recovery window) until a decode
        worker has been heard on it, and skip those not heard yet: NATS delivers nothing to a
        subscription that is not back yet. Also waits while no decode worker is routable but
        some are being pinged (silent, not yet confirmed gone: a starved event loop, say)."""
        while True:
            if self.bus.connected:
                recovering = not self._recovery_over()
                unheard = self._unheard()
                if any(w.worker_id not in unheard for w in self.router.serving("decode")):
                    return unheard
                if not recovering and not self._decode_suspects():
                    return unheard  # nobody to wait for: the caller finds no worker
            if time.time() >= deadline:
                raise StageTimeout("no decode worker was reachable before the request's deadline")
            await asyncio.sleep(RECOVERY_POLL_SECONDS)

    def _decode_suspects(self) -> bool:
        return any(e.load.role == "decode" for e in self.workers.suspects.values())

    # -- legs migrated away --------------------------------------------------------------------

    def abandon(self, worker_id: str, bus_id: str, deadline: float) -> None:
        """A leg migrates away from ``worker_id``: cancel it there (a worker that was not really
        gone frees its blocks), now and again if that worker turns up again."""
        self.spawn(self.cancel(bus_id))
        self._abandoned.add(worker_id, bus_id, deadline)

    def _cancel_abandoned(self, worker_id: str | None) -> None:
        for bus_id in self._abandoned.to_cancel(worker_id):
            self.spawn(self.cancel(bus_id))

    async def _cancel_abandoned_when_heard(self) -> None:
        """After a reconnect: cancel the abandoned legs again once workers are heard (the
        cancels sent right after the reconnect may have beaten their subscriptions back)."""
        with contextlib.suppress(StageTimeout):
            await self.recovered(time.time() + RECOVERY_TIMEOUTS * self.workers.timeout)
        self._cancel_abandoned(None)

    def count_migration(self, reason: str) -> None:
        if self._migrations is not None:
            self._migrations.labels(reason=reason).inc()

    def register(self, bus_id: str, request: InFlight) -> None:
        self._pending[bus_id] = request

    def unregister(self, bus_id: str) -> None:
        self._pending.pop(bus_id, None)
        self.router.decode_done(bus_id)

    # -- the router's picks, for a request in flight --------------------------------------------

    def pick_prefill(self, prompt: list[int], exclude: set[str], bus_id: str) -> str | None:
        return self.router.pick_prefill(prompt, exclude, bus_id)

    def prefill_done(self, bus_id: str) -> None:
        self.router.prefill_done(bus_id)

    def can_stream(self, kv_layout: str = "") -> bool:
        return self.router.can_stream(kv_layout)

    def not_streaming(self, kv_layout: str) -> set[str]:
        return self.router.not_streaming(kv_layout)

    def pick_decode(
        self, total_tokens: int, exclude: set[str], bus_id: str, kv_layout: str
    ) -> str | None:
        return self.router.pick_decode(total_tokens, exclude, bus_id, kv_layout)

    # -- outgoing ----------------------------------------------------------------------------

    async def _publish(self, subject: str, msg, headers: dict[str, str] | None = None) -> None:
        try:
            await self.bus.publish(subject, msg, headers)
        except Exception as exc:  # closed or never-connected bus: fail the request, loudly
            raise WorkerFailure(f"message bus unavailable: {exc}", "bus_unavailable") from exc

    async def send(
        self, worker: str, msg: PrefillRequest | DecodeRequest, headers: dict[str, str]
    ) -> None:
        """Send a request (or a leg of one) to the prefill or decode ``worker``."""
        subjects = self.bus.subjects
        subject = subjects.prefill if isinstance(msg, PrefillRequest) else subjects.decode
        await self._publish(subject(worker), msg, headers)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Fire-and-forget publish that survives the cancellation of the request's task."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    def check_stream(self, worker_id: str, bus_id: str) -> None:
        """Ask ``worker_id`` where the stream ``bus_id`` stands (``gateway/legs.py``);
        a check that cannot go out now is sent again."""
        check = StreamCheck(bus_id, self.inbox)
        self.spawn(self._publish(self.bus.subjects.decode(worker_id), check))

    async def cancel(self, bus_id: str, index: int | None = None) -> None:
        """Cancel a request on every worker, or only its choice ``index``."""
        await self._publish(self.bus.subjects.cancel, Cancel(bus_id, index))

    async def release_stale(self, item: object) -> None:
        """Free the leased KV blocks of a prefill answer nobody will pull."""
        if isinstance(item, PrefillResult) and item.kv is not None:
            await self._publish(
                self.bus.subjects.lease(item.kv.worker_id), ReleaseLease(item.bus_id)
            )

    # -- one request -------------------------------------------------------------------------

    async def generate(
        self,
        client_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        context: Context | None = None,
        choices: OpenChoices | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Yield the request's tokens as they arrive; the last event has a finish reason.

        ``client_id`` is the client's x-request-id: it names the request on spans; on the bus
        the request travels under a unique id of its own (``new_bus_id``).

        With ``sampling.n > 1`` events carry their choice's index, and ``choices`` lets the caller
        stop one choice early (a stop string in its text).

        A request whose decode worker is lost is migrated (``gateway/legs.py``); for
        its randomness to continue exactly, a sampled request without a seed gets one here.

        Raises NoWorker before anything was sent, StageTimeout or WorkerFailure on faults.
        Closing the generator early (client gone, stop string) cancels the request.
        """
        sampling = with_fixed_seed(sampling)
        bus_id = new_bus_id(client_id)
        self._check_wire(bus_id, prompt_token_ids, sampling)
        limits, headers = self._limits(), inject_headers(context=context)
        request = InFlight(
            self, limits, client_id, bus_id, prompt_token_ids, sampling, context, headers, choices
        )
        with self._tracking(request):
            if self._route(request):
                first = await request.prefill()
                if first is not None:
                    yield first
            if not request.finished:
                async for event in request.decode():
                    yield event

    def _limits(self) -> Limits:
        """What a request arriving now runs under."""
        return Limits(
            request_timeout=self.request_timeout,
            prefill_timeout=self.prefill_timeout,
            first_token_timeout=self.first_token_timeout,
            stall_timeout=self.stall_timeout,
            max_migrations=self.max_migrations,
            worker_timeout=self.workers.timeout,
        )

    @contextlib.contextmanager
    def _tracking(self, request: InFlight) -> Iterator[None]:
        """Route the request's messages to it while it lives. Its one way out, however it ends:
        every bus id still routed to it is unregistered, and cancelled on the workers unless the
        request finished normally."""
        self.register(request.bus_id, request)
        try:
            yield
        finally:
            ids = sorted(bus_id for bus_id, r in self._pending.items() if r is request)
            for bus_id in ids:
                self.unregister(bus_id)
            if not request.finished:
                # Runs even while the handler is being cancelled (client gone), so it must not
                # await anything that the cancellation could interrupt.
                for bus_id in ids:
                    self.spawn(self.cancel(bus_id))

    def _route(self, request: InFlight) -> bool:
        """Whether the request goes to a prefill worker first (else a decode worker prefills)."""
        with _tracer.start_as_current_span(SPAN_ROUTE, context=request.context) as span:
            span.set_attribute(ATTR_REQUEST_ID, request.client_id)
            span.set_attribute("pdserve.bus_request_id", request.bus_id)
            # short prompts go straight to a decode worker (the workers advertise the threshold)
            use_prefill = self.router.has_prefill() and (
                len(request.prompt) >= self.router.local_prefill_threshold()
            )
            span.set_attribute("pdserve.route.prefill", use_prefill)
            if not self.router.has_decode():  # even with a prefill worker: none could decode
                raise NoWorker("no decode worker is available")
        return use_prefill

    def _check_wire(self, bus_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        """Refuse up front what a worker's decoder would drop: a dropped request would only
        surface as a timeout much later."""
        probe = DecodeRequest(bus_id, prompt, [], sampling, None, self.inbox, time.time())
        try:
            protocol.decode(protocol.encode(probe), self.bus.max_bytes)
        except protocol.ProtocolError as exc:
            raise NotSendable(str(exc)) from None

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 1.0)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background publish failed: %s", task.exception())
