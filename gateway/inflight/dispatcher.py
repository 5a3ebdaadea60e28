"""The gateway's bus inbox and routing table, and the way in for each request on the bus.

One inbox subscription (``{ns}.gw.{gateway_id}``) receives every ``PrefillResult`` and
``TokenBatch`` for this gateway; each item is handed to the request its bus id is routed to (a
``BusRequest``, ``bus_request.py``). ``Dispatcher.generate`` admits one request to the bus and
drives it through its stages (the life cycle: ``gateway/inflight/__init__.py``); ``_tracking``
is its one way out, however it ends. The ``Dispatcher`` builds the ``RequestPort`` its requests
share: the ``Outbox`` (``outbox.py``), the router, ``Departures`` (``departures.py``) and this
routing table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from opentelemetry.context import Context

from pdserve.gateway.inflight.bus_request import BusRequest
from pdserve.gateway.inflight.delivery import OpenChoices, TokenEvent
from pdserve.gateway.inflight.departures import Departures
from pdserve.gateway.inflight.faults import NotSendable, NoWorker
from pdserve.gateway.inflight.legs import new_bus_id, with_fixed_seed
from pdserve.gateway.inflight.limits import DEFAULT_MAX_MIGRATIONS, Limits
from pdserve.gateway.inflight.outbox import Outbox
from pdserve.gateway.inflight.port import RequestPort
from pdserve.gateway.inflight.queue_items import Addressee
from pdserve.gateway.router import Router
from pdserve.shared.bus import protocol
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.request_messages import DecodeRequest, PrefillResult
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from pdserve.shared.sampling import SamplingParams
from pdserve.shared.telemetry.tracing import ATTR_REQUEST_ID, SPAN_ROUTE, inject_headers, tracer

_tracer = tracer(__name__)


class Dispatcher:
    """The gateway's bus inbox and its routing table, and the way in for each request
    (``generate``)."""

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
        # seconds, 0 = no limit (request: a total cap; see bus_request.py)
        self.request_timeout = request_timeout
        self.prefill_timeout = prefill_timeout
        self.first_token_timeout = first_token_timeout
        self.stall_timeout = stall_timeout
        self.max_migrations = max_migrations
        self._migrations = migrations
        self._pending: dict[str, Addressee] = {}  # bus id -> request
        self.outbox = Outbox(bus, self.inbox)
        self.departures = Departures(bus, workers, router, self.outbox, self._requests)
        self.port = RequestPort(
            outbox=self.outbox,
            router=router,
            departures=self.departures,
            routes=self,
            count_migration=self.count_migration,
        )

    async def start(self) -> None:
        await self.bus.subscribe(self.inbox, self._on_message, (PrefillResult, TokenBatch))

    async def close(self) -> None:
        await self.outbox.close()

    # -- the inbox and its routing table -----------------------------------------------------

    async def _on_message(self, msg: PrefillResult | TokenBatch, headers: dict[str, str]) -> None:
        for item in [msg] if isinstance(msg, PrefillResult) else msg.items:
            self._deliver(item.bus_id, item)

    def _deliver(self, bus_id: str, item: PrefillResult | TokenItem) -> None:
        request = self._pending.get(bus_id)
        if request is not None:
            request.put(item)
        elif isinstance(item, PrefillResult) and item.kv is not None:
            # ended already: free its blocks now
            self.outbox.spawn(self.outbox.release_stale(item))

    def _requests(self) -> list[Addressee]:
        return list(dict.fromkeys(self._pending.values()))  # a request may have several ids

    def register(self, bus_id: str, request: Addressee) -> None:
        self._pending[bus_id] = request

    def unregister(self, bus_id: str) -> None:
        self._pending.pop(bus_id, None)
        self.router.decode_done(bus_id)

    def count_migration(self, reason: str) -> None:
        if self._migrations is not None:
            self._migrations.labels(reason=reason).inc()

    # -- one request -------------------------------------------------------------------------

    async def generate(
        self,
        client_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        context: Context | None = None,
        choices: OpenChoices | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Yield the request's tokens as they arrive; the last event has a finish reason.

        ``client_id`` is the client's x-request-id: it names the request on spans; on the bus
        the request travels under a unique id of its own (``new_bus_id``).

        With ``sampling.n > 1`` events carry their choice's index, and ``choices`` lets the caller
        stop one choice early (a stop string in its text). ``lora``: the LoRA adapter it runs
        under on both workers (None: the base model); the router prefers workers holding it.

        A request whose decode worker is lost is migrated (``legs.py``); for
        its randomness to continue exactly, a sampled request without a seed gets one here.

        Raises NoWorker before anything was sent, StageTimeout or WorkerFailure on faults.
        Closing the generator early (client gone, stop string) cancels the request.
        """
        sampling = with_fixed_seed(sampling)
        bus_id = new_bus_id(client_id)
        self._check_wire(bus_id, prompt_token_ids, sampling)
        request = BusRequest(
            port=self.port,
            limits=self._limits(),
            client_id=client_id,
            bus_id=bus_id,
            prompt=prompt_token_ids,
            sampling=sampling,
            context=context,
            headers=inject_headers(context=context),
            choices=choices,
            lora=lora,
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
    def _tracking(self, request: BusRequest) -> Iterator[None]:
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
                    self.outbox.spawn(self.outbox.cancel(bus_id))

    def _route(self, request: BusRequest) -> bool:
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
        probe = DecodeRequest(
            bus_id=bus_id,
            prompt_token_ids=prompt,
            output_token_ids=[],
            sampling=sampling,
            kv=None,
            reply_to=self.inbox,
            deadline=time.time(),
        )
        try:
            protocol.decode(protocol.encode(probe), self.bus.max_bytes)
        except protocol.ProtocolError as exc:
            raise NotSendable(str(exc)) from None
