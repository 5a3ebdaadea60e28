"""The gateway's side of a request's life on the bus.

One inbox subscription (``{ns}.gw.{gateway_id}``) receives every ``PrefillResult`` and
``TokenBatch`` for this gateway; each is handed to the waiting request (an ``InFlight``, see
``gateway/inflight.py``) by request id. ``Dispatcher.generate`` drives one request through the
stages of the design:

    route -> PrefillRequest to a prefill worker -> first token (yielded at once)
          -> DecodeRequest with the KV handle to a decode worker -> tokens as they come

or, when no prefill worker is alive or the prompt is short, straight to a decode worker that
prefills locally. Every wait has a deadline, a worker leaving the registry fails (or, for
prefill, retries) its requests at once, and a request that ends early - client gone, stop
string, error - is cancelled on the workers so they free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator

from opentelemetry.context import Context

from gateway.inflight import (
    DECODE_ATTEMPTS,
    PREFILL_ATTEMPTS,
    RETRYABLE_CODES,
    TYPICAL_OUTPUT_TOKENS,
    Choices,
    InFlight,
    NotSendable,
    NoWorker,
    StageTimeout,
    TokenEvent,
    WorkerFailure,
)
from gateway.router import Router
from shared import protocol
from shared.bus import Bus
from shared.protocol import (
    Cancel,
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    ReleaseLease,
    TokenBatch,
    TokenItem,
    WorkerLoad,
)
from shared.sampling import SamplingParams
from shared.subjects import MAX_ID_CHARS
from shared.tracing import ATTR_REQUEST_ID, SPAN_ROUTE, inject_headers, tracer
from shared.worker_registry import LEFT, WorkerRegistry

__all__ = [
    "BUS_ID_SUFFIX",
    "Choices",
    "DECODE_ATTEMPTS",
    "PREFILL_ATTEMPTS",
    "RETRYABLE_CODES",
    "TYPICAL_OUTPUT_TOKENS",
    "Dispatcher",
    "NoWorker",
    "NotSendable",
    "StageTimeout",
    "TokenEvent",
    "WorkerFailure",
    "new_bus_id",
]

log = logging.getLogger("pdserve.gateway.dispatch")
_tracer = tracer(__name__)

BUS_ID_SUFFIX = 16  # hex digits of randomness in a request's bus id


def new_bus_id(client_request_id: str) -> str:
    """A request's id on the bus: the client's x-request-id (readable in worker logs) plus a
    random suffix. Clients reuse ids (retries, two tabs, two gateways behind one balancer), and
    a shared bus id would let one request's cancel or tokens reach the other."""
    keep = MAX_ID_CHARS - BUS_ID_SUFFIX - 1
    return f"{client_request_id[:keep]}-{secrets.token_hex(BUS_ID_SUFFIX // 2)}"


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        workers: WorkerRegistry,
        router: Router,
        gateway_id: str,
        request_timeout: float,
        prefill_timeout: float,
    ) -> None:
        self.bus = bus
        self.workers = workers
        self.router = router
        self.inbox = bus.subjects.gateway(gateway_id)
        self.request_timeout = request_timeout
        self.prefill_timeout = prefill_timeout
        self._pending: dict[str, InFlight] = {}  # bus id -> request
        self._background: set[asyncio.Task] = set()
        workers.add_listener(self._on_registry_event)

    async def start(self) -> None:
        await self.bus.subscribe(self.inbox, self._on_message, (PrefillResult, TokenBatch))

    # -- incoming ----------------------------------------------------------------------------

    async def _on_message(self, msg: PrefillResult | TokenBatch, headers: dict[str, str]) -> None:
        if isinstance(msg, PrefillResult):
            self._deliver(msg.request_id, msg)
            return
        for item in msg.items:
            self._deliver(item.request_id, item)

    def _deliver(self, request_id: str, item: PrefillResult | TokenItem) -> None:
        request = self._pending.get(request_id)
        if request is not None:
            request.put(item)
        elif isinstance(item, PrefillResult) and item.kv is not None:
            # A late answer for a request that already ended: free its blocks now rather than
            # when the lease runs out.
            self.spawn(self.release_stale(item))

    def _on_registry_event(self, event: str, load: WorkerLoad) -> None:
        # LEFT means gone for sure: a clean WorkerGone, a restart, or missed heartbeats that a
        # ping confirmed (a slow but live worker answers it and keeps its requests).
        if event != LEFT:
            return
        for request in self._pending.values():
            request.worker_left(load.worker_id)

    # -- outgoing ----------------------------------------------------------------------------

    async def _publish(self, subject: str, msg, headers: dict[str, str] | None = None) -> None:
        try:
            await self.bus.publish(subject, msg, headers)
        except Exception as exc:  # closed or never-connected bus: fail the request, loudly
            raise WorkerFailure(f"message bus unavailable: {exc}", "bus_unavailable") from exc

    async def send_prefill(self, worker: str, msg: PrefillRequest, headers: dict[str, str]):
        await self._publish(self.bus.subjects.prefill(worker), msg, headers)

    async def send_decode(self, worker: str, msg: DecodeRequest, headers: dict[str, str]):
        await self._publish(self.bus.subjects.decode(worker), msg, headers)

    def spawn(self, coro) -> None:
        """Fire-and-forget publish that survives the cancellation of the request's task."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def cancel(self, request_id: str, index: int | None = None) -> None:
        """Cancel a request on every worker, or only its choice ``index``."""
        await self._publish(self.bus.subjects.cancel, Cancel(request_id, index))

    async def release_stale(self, item: object) -> None:
        """Free the leased KV blocks of a prefill answer nobody will pull."""
        if isinstance(item, PrefillResult) and item.kv is not None:
            await self._publish(
                self.bus.subjects.lease(item.kv.worker_id), ReleaseLease(item.request_id)
            )

    # -- one request -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        context: Context | None = None,
        choices: Choices | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Yield the request's tokens as they arrive; the last event has a finish reason.

        ``request_id`` is the client's x-request-id: it names the request on spans; on the bus
        the request travels under a unique id of its own (``new_bus_id``).

        With ``sampling.n > 1`` events carry their choice's index, and ``choices`` lets the caller
        stop one choice early (a stop string in its text).

        Raises NoWorker before anything was sent, StageTimeout or WorkerFailure on faults.
        Closing the generator early (client gone, stop string) cancels the request.
        """
        bus_id = new_bus_id(request_id)
        self._check_wire(bus_id, prompt_token_ids, sampling)
        request = InFlight(
            self,
            request_id,
            bus_id,
            prompt_token_ids,
            sampling,
            context,
            inject_headers(context=context),
            choices,
        )
        with self._tracking(request):
            if self._route(request):
                first = await request.prefill()
                if first is not None:
                    yield first
            if not request.finished:
                async for event in request.decode():
                    yield event

    @contextlib.contextmanager
    def _tracking(self, request: InFlight) -> Iterator[None]:
        """Route the request's messages to it while it lives; cancel it if it ends early."""
        self._pending[request.bus_id] = request
        try:
            yield
        finally:
            self._pending.pop(request.bus_id, None)
            self.router.prefill_done(request.bus_id)
            self.router.decode_done(request.bus_id)
            if not request.finished:
                # Runs even while the handler is being cancelled (client gone), so it must not
                # await anything that the cancellation could interrupt.
                self.spawn(self.cancel(request.bus_id))

    def _route(self, request: InFlight) -> bool:
        """Whether the request goes to a prefill worker first (else a decode worker prefills)."""
        with _tracer.start_as_current_span(SPAN_ROUTE, context=request.context) as span:
            span.set_attribute(ATTR_REQUEST_ID, request.client_id)
            span.set_attribute("pdserve.bus_request_id", request.bus_id)
            use_prefill = self._wants_prefill(len(request.prompt))
            span.set_attribute("pdserve.route.prefill", use_prefill)
            if not self.router.has_decode():  # even with a prefill worker: none could decode
                raise NoWorker("no decode worker is available")
        return use_prefill

    def _check_wire(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        """Refuse up front what a worker's decoder would drop: a dropped request would only
        surface as a timeout much later."""
        probe = DecodeRequest(request_id, prompt, [], sampling, None, self.inbox, time.time())
        try:
            protocol.decode(protocol.encode(probe), self.bus.max_bytes)
        except protocol.ProtocolError as exc:
            raise NotSendable(str(exc)) from None

    def _wants_prefill(self, prompt_len: int) -> bool:
        if not self.router.has_prefill():
            return False
        return prompt_len >= self.router.local_prefill_threshold()

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 1.0)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background publish failed: %s", task.exception())
