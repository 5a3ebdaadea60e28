"""The gateway's side of a request's life on the bus.

One inbox subscription (``{ns}.gw.{gateway_id}``) receives every ``PrefillResult`` and
``TokenBatch`` for this gateway; each is handed to the waiting request's queue by request id.
``Dispatcher.generate`` drives one request through the stages of the design:

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
from collections.abc import AsyncIterator
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

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
from shared.tracing import ATTR_REQUEST_ID, SPAN_ROUTE, inject_headers, tracer
from shared.worker_registry import LEFT, WorkerRegistry

log = logging.getLogger("pdserve.gateway.dispatch")
_tracer = tracer(__name__)

PREFILL_ATTEMPTS = 3  # prefill is idempotent: a dead or overloaded worker's request goes elsewhere
DECODE_ATTEMPTS = 3  # a decode worker that refuses a request before its first token
RETRYABLE_CODES = ("overloaded", "draining")
TYPICAL_OUTPUT_TOKENS = 256
BUS_ID_SUFFIX = 16  # hex digits of randomness in a request's bus id


def new_bus_id(client_request_id: str) -> str:
    """A request's id on the bus: the client's x-request-id (readable in worker logs) plus a
    random suffix. Clients reuse ids (retries, two tabs, two gateways behind one balancer), and
    a shared bus id would let one request's cancel or tokens reach the other."""
    keep = protocol.MAX_ID_CHARS - BUS_ID_SUFFIX - 1
    return f"{client_request_id[:keep]}-{secrets.token_hex(BUS_ID_SUFFIX // 2)}"


class NoWorker(Exception):
    """No worker can take the request now (answer 503 with Retry-After)."""


class NotSendable(Exception):
    """The request does not fit the wire protocol (its bounds or the bus message size)."""


class StageTimeout(Exception):
    """A stage passed its deadline."""


class WorkerFailure(Exception):
    """A worker failed the request or vanished mid-request (a server fault, not bad input)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int | None = None  # set on the event carrying the prefill result


@dataclass
class _WorkerLeft:
    worker_id: str


class _Pending:
    """A request waiting for messages from workers."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[PrefillResult | TokenItem | _WorkerLeft] = asyncio.Queue()
        self.workers: set[str] = set()  # whose departure should wake this request


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        registry: WorkerRegistry,
        router: Router,
        gateway_id: str,
        request_timeout: float,
        prefill_timeout: float,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.router = router
        self.inbox = bus.subjects.gateway(gateway_id)
        self.request_timeout = request_timeout
        self.prefill_timeout = prefill_timeout
        self._pending: dict[str, _Pending] = {}
        self._background: set[asyncio.Task] = set()
        registry.add_listener(self._on_registry_event)

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
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.queue.put_nowait(item)
        elif isinstance(item, PrefillResult) and item.kv is not None:
            # A late answer for a request that already ended: free its blocks now rather than
            # when the lease runs out.
            self._spawn(self._release_stale(item))

    def _on_registry_event(self, event: str, load: WorkerLoad) -> None:
        # LEFT means gone for sure: a clean WorkerGone, a restart, or missed heartbeats that a
        # ping confirmed (a slow but live worker answers it and keeps its requests).
        if event != LEFT:
            return
        for pending in self._pending.values():
            if load.worker_id in pending.workers:
                pending.queue.put_nowait(_WorkerLeft(load.worker_id))

    # -- outgoing ----------------------------------------------------------------------------

    async def _publish(self, subject: str, msg, headers: dict[str, str] | None = None) -> None:
        try:
            await self.bus.publish(subject, msg, headers)
        except Exception as exc:  # closed or never-connected bus: fail the request, loudly
            raise WorkerFailure(f"message bus unavailable: {exc}", "bus_unavailable") from exc

    def _spawn(self, coro) -> None:
        """Fire-and-forget publish that survives the cancellation of the request's task."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def cancel(self, request_id: str) -> None:
        await self._publish(self.bus.subjects.cancel, Cancel(request_id))

    # -- one request -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        context: Context | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Yield the request's tokens as they arrive; the last event has a finish reason.

        ``request_id`` is the client's x-request-id: it names the request on spans; on the bus
        the request travels under a unique id of its own (``new_bus_id``).

        Raises NoWorker before anything was sent, StageTimeout or WorkerFailure on faults.
        Closing the generator early (client gone, stop string) cancels the request.
        """
        client_id, request_id = request_id, new_bus_id(request_id)
        self._check_wire(request_id, prompt_token_ids, sampling)
        pending = _Pending()
        self._pending[request_id] = pending
        headers = inject_headers(context=context)
        deadline = time.time() + self.request_timeout
        finished = False
        try:
            with _tracer.start_as_current_span(SPAN_ROUTE, context=context) as span:
                span.set_attribute(ATTR_REQUEST_ID, client_id)
                span.set_attribute("pdserve.bus_request_id", request_id)
                use_prefill = self._wants_prefill(len(prompt_token_ids))
                span.set_attribute("pdserve.route.prefill", use_prefill)
                if not use_prefill and not self.router.has_decode():
                    raise NoWorker("no decode worker is available")

            output: list[int] = []
            kv = None
            if use_prefill:
                result = await self._prefill(
                    request_id, client_id, prompt_token_ids, sampling, headers, deadline, pending
                )
                if result is not None:
                    _check_ending(result.finish_reason, result.worker_id)
                    if result.first_token is not None:
                        output.append(result.first_token)
                    yield TokenEvent(list(output), result.finish_reason, result.cached_tokens)
                    if result.finish_reason is not None:
                        finished = True  # done at the first token (max_tokens=1, EOS, ...)
                        self._spawn(self._release_stale(result))  # its KV is not needed
                        return
                    kv = result.kv

            tried: set[str] = set()
            while True:
                # Most requests stop long before max_tokens (which for chat defaults to the whole
                # context), so the load estimate counts only a typical output length.
                expected = len(prompt_token_ids) + min(sampling.max_tokens, TYPICAL_OUTPUT_TOKENS)
                decode_worker = self.router.pick_decode(expected, tried, request_id)
                if decode_worker is None:
                    if output:  # the client has its first token: this is now a failure
                        raise WorkerFailure("no decode worker can take the request", "no_worker")
                    raise NoWorker("no decode worker can take the request")
                tried.add(decode_worker)
                pending.workers = {decode_worker}
                trace.get_current_span(context).set_attribute(
                    "pdserve.decode_worker", decode_worker
                )
                await self._publish(
                    self.bus.subjects.decode(decode_worker),
                    DecodeRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt_token_ids,
                        output_token_ids=output,
                        sampling=sampling,
                        kv=kv,
                        reply_to=self.inbox,
                        deadline=deadline,
                        client_request_id=client_id,
                    ),
                    headers,
                )
                streamed = False
                while True:
                    item = await self._next(pending, deadline, "decode")
                    if isinstance(item, _WorkerLeft):
                        raise WorkerFailure(
                            f"decode worker {item.worker_id} stopped while serving the request",
                            "worker_lost",
                        )
                    if not isinstance(item, TokenItem):
                        await self._release_stale(item)  # a late answer of a retried prefill
                        continue
                    if item.error is not None:
                        if (
                            not streamed
                            and item.error_code in RETRYABLE_CODES
                            and len(tried) < DECODE_ATTEMPTS
                        ):
                            # Refused before it started (full or draining). The refusing worker
                            # dropped any KV lease, so the next one prefills locally.
                            log.info("decode worker %s refused %s", decode_worker, request_id)
                            kv = None
                            break
                        raise WorkerFailure(item.error, item.error_code)
                    _check_ending(item.finish_reason, decode_worker)
                    streamed = True
                    # cached_tokens is set when this decode worker prefilled the prompt itself
                    yield TokenEvent(list(item.token_ids), item.finish_reason, item.cached_tokens)
                    if item.finish_reason is not None:
                        finished = True
                        return
        finally:
            self._pending.pop(request_id, None)
            self.router.prefill_done(request_id)
            self.router.decode_done(request_id)
            if not finished:
                # Runs even while the handler is being cancelled (client gone), so it must not
                # await anything that the cancellation could interrupt.
                self._spawn(self.cancel(request_id))

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

    async def _prefill(
        self,
        request_id: str,
        client_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        headers: dict[str, str],
        deadline: float,
        pending: _Pending,
    ) -> PrefillResult | None:
        """Run the prefill stage; None means no prefill worker could take it (prefill locally)."""
        tried: set[str] = set()
        for _ in range(PREFILL_ATTEMPTS):
            worker = self.router.pick_prefill(prompt, exclude=tried, request_id=request_id)
            if worker is None:
                return None
            tried.add(worker)
            pending.workers.add(worker)
            trace.get_current_span().set_attribute("pdserve.prefill_worker", worker)
            stage_deadline = min(deadline, time.time() + self.prefill_timeout)
            await self._publish(
                self.bus.subjects.prefill(worker),
                PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    reply_to=self.inbox,
                    deadline=stage_deadline,
                    client_request_id=client_id,
                ),
                headers,
            )
            try:
                while True:
                    item = await self._next(pending, stage_deadline, "prefill")
                    if isinstance(item, _WorkerLeft):
                        if item.worker_id != worker:
                            continue
                        log.warning("prefill worker %s left; retrying %s", worker, request_id)
                        result = None
                        break
                    if isinstance(item, PrefillResult) and item.worker_id == worker:
                        result = item
                        break
                    await self._release_stale(item)
            finally:
                pending.workers.discard(worker)
                self.router.prefill_done(request_id)  # no longer queued work on that worker
            if result is None:
                continue
            if result.error is None:
                return result
            if result.error_code in RETRYABLE_CODES:
                log.info("prefill worker %s refused %s: %s", worker, request_id, result.error)
                continue
            raise WorkerFailure(f"prefill failed: {result.error}", result.error_code)
        # Every prefill worker we tried refused or vanished: a decode worker can still prefill.
        return None

    async def _release_stale(self, item: object) -> None:
        """Free the leased KV blocks of a prefill answer nobody will pull."""
        if isinstance(item, PrefillResult) and item.kv is not None:
            await self._publish(
                self.bus.subjects.lease(item.kv.worker_id), ReleaseLease(item.request_id)
            )

    async def _next(self, pending: _Pending, deadline: float, stage: str):
        remaining = deadline - time.time()
        if remaining <= 0:
            raise StageTimeout(f"the {stage} stage passed its deadline")
        try:
            return await asyncio.wait_for(pending.queue.get(), remaining)
        except asyncio.TimeoutError:
            raise StageTimeout(f"the {stage} stage passed its deadline") from None

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 1.0)


def _check_ending(finish_reason: str | None, worker_id: str) -> None:
    """Only "stop" and "length" are a normal end; a worker-side abort or error without a
    message must still reach the client as an error, never as a short successful answer."""
    if finish_reason not in (None, "stop", "length"):
        raise WorkerFailure(
            f"worker {worker_id} ended the request ({finish_reason})", finish_reason
        )


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background publish failed: %s", task.exception())
