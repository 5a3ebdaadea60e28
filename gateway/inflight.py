"""One request in flight on the bus, from the gateway's side: its ids, deadline, inbox queue
and stage, and the two stages it goes through.

``InFlight.prefill()`` sends the prompt to a prefill worker (retrying elsewhere when one refuses
or vanishes) and returns the first token with the KV handle; ``InFlight.decode()`` sends the
request - with that handle, or without one to have the decode worker prefill it locally - to a
decode worker and yields its tokens, moving on to another decode worker when one refuses before
its first token. Every wait is bounded by the stage's deadline; the dispatcher feeds the queue
(worker answers, and the departure of a worker this request is waiting on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

from shared.logprobs import TokenLogprobs
from shared.protocol import (
    DecodeRequest,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    TokenItem,
)
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from gateway.dispatch import Dispatcher

log = logging.getLogger("pdserve.gateway.dispatch")

PREFILL_ATTEMPTS = 3  # prefill is idempotent: a dead or overloaded worker's request goes elsewhere
DECODE_ATTEMPTS = 3  # a decode worker that refuses a request before its first token
RETRYABLE_CODES = ("overloaded", "draining")
TYPICAL_OUTPUT_TOKENS = 256


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
    finish_reason: str | None  # of choice ``index``
    cached_tokens: int | None = None  # set on the event carrying the prefill result
    index: int = 0  # the choice (sampling.n > 1)
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked
    prompt_logprobs: TokenLogprobs | None = None  # once, when asked (echo)


class Choices:
    """The choices of one request that are still being generated. The consumer may end one
    early (a stop string matched in its text): the workers stop generating it, and the request
    is over once no choice is open."""

    def __init__(self, n: int) -> None:
        self.open = set(range(n))
        self._cancel: Callable[[int], None] | None = None

    def bind(self, cancel: Callable[[int], None]) -> None:
        self._cancel = cancel

    def stop(self, index: int) -> None:
        if index not in self.open:
            return
        self.open.discard(index)
        if self.open and self._cancel is not None:
            # the last one ends the request itself, which cancels it whole
            self._cancel(index)

    def ended(self, index: int) -> None:
        self.open.discard(index)


@dataclass
class WorkerLeft:
    """Put on a request's queue when a worker it waits on leaves the registry."""

    worker_id: str


Item = PrefillResult | TokenItem | WorkerLeft


class InFlight:
    """One request on the bus: created by ``Dispatcher.generate``, which drives its stages."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        client_id: str,
        bus_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        context: Context | None,
        headers: dict[str, str],
        choices: Choices | None = None,
    ) -> None:
        self.d = dispatcher
        self.client_id = client_id  # the client's x-request-id: names the request on spans
        self.bus_id = bus_id  # unique: names it on the bus (see new_bus_id)
        self.prompt = prompt
        self.sampling = sampling
        self.context = context
        self.headers = headers
        self.deadline = time.time() + dispatcher.request_timeout
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.watching: set[str] = set()  # workers whose departure should wake this request
        self.stage = "route"
        self.output: list[int] = []  # tokens generated before the decode stage
        self.kv: KVHandle | None = None
        self.finished = False  # ended normally: nothing to cancel on the workers
        self.choices = choices or Choices(sampling.n)
        self.choices.bind(lambda index: dispatcher.spawn(dispatcher.cancel(bus_id, index)))

    # -- the dispatcher's side ---------------------------------------------------------------

    def put(self, item: Item) -> None:
        self.queue.put_nowait(item)

    def worker_left(self, worker_id: str) -> None:
        if worker_id in self.watching:
            self.put(WorkerLeft(worker_id))

    async def _next(self, deadline: float) -> Item:
        remaining = deadline - time.time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            if not self.queue.empty():  # already here: no timer and no task to wait
                return self.queue.get_nowait()
            return await asyncio.wait_for(self.queue.get(), remaining)
        except asyncio.TimeoutError:
            raise StageTimeout(f"the {self.stage} stage passed its deadline") from None

    def _annotate(self, key: str, worker_id: str) -> None:
        trace.get_current_span(self.context).set_attribute(key, worker_id)

    # -- prefill -----------------------------------------------------------------------------

    async def prefill(self) -> TokenEvent | None:
        """Prefill on a prefill worker. Returns the first token's event, or None when no prefill
        worker could take the request (a decode worker then prefills it locally)."""
        self.stage = "prefill"
        tried: set[str] = set()
        for _ in range(PREFILL_ATTEMPTS):
            worker = self.d.router.pick_prefill(self.prompt, exclude=tried, request_id=self.bus_id)
            if worker is None:
                return None
            tried.add(worker)
            result = await self._prefill_on(worker)
            if result is None:
                continue  # it left: prefill is idempotent, so try another
            if result.error is None:
                return self._first_token(result)
            if result.error_code in RETRYABLE_CODES:
                log.info("prefill worker %s refused %s: %s", worker, self.bus_id, result.error)
                continue
            raise WorkerFailure(f"prefill failed: {result.error}", result.error_code)
        # Every prefill worker we tried refused or vanished: a decode worker can still prefill.
        return None

    async def _prefill_on(self, worker: str) -> PrefillResult | None:
        """Send the prompt to ``worker`` and wait for its answer; None if it left meanwhile."""
        self.watching.add(worker)
        self._annotate("pdserve.prefill_worker", worker)
        deadline = min(self.deadline, time.time() + self.d.prefill_timeout)
        try:
            await self.d.send_prefill(
                worker,
                PrefillRequest(
                    request_id=self.bus_id,
                    prompt_token_ids=self.prompt,
                    sampling=self.sampling,
                    reply_to=self.d.inbox,
                    deadline=deadline,
                    client_request_id=self.client_id,
                ),
                self.headers,
            )
            while True:
                item = await self._next(deadline)
                if isinstance(item, WorkerLeft):
                    if item.worker_id == worker:
                        log.warning("prefill worker %s left; retrying %s", worker, self.bus_id)
                        return None
                elif isinstance(item, PrefillResult) and item.worker_id == worker:
                    return item
                else:
                    await self.d.release_stale(item)  # a late answer of an earlier attempt
        finally:
            self.watching.discard(worker)
            self.d.router.prefill_done(self.bus_id)  # no longer queued work on that worker

    def _first_token(self, result: PrefillResult) -> TokenEvent:
        """Choice 0's first token (a prefill worker never forks: the decode worker does)."""
        _check_ending(result.finish_reason, result.worker_id)
        if result.first_token is not None:
            self.output.append(result.first_token)
        if result.finish_reason is not None:
            self.choices.ended(0)  # done at the first token (max_tokens=1, EOS, ...)
        if self.choices.open:
            self.kv = result.kv
        else:
            self.finished = True
            self.d.spawn(self.d.release_stale(result))  # its KV is not needed
        return TokenEvent(
            list(self.output),
            result.finish_reason,
            result.cached_tokens,
            logprobs=result.first_logprobs,
            prompt_logprobs=result.prompt_logprobs,
        )

    # -- decode ------------------------------------------------------------------------------

    async def decode(self) -> AsyncIterator[TokenEvent]:
        """Yield the tokens of a decode worker until the request finishes. A worker that
        refuses before its first token (full or draining) hands the request to another."""
        self.stage = "decode"
        tried: set[str] = set()
        worker = await self._send_decode(tried)
        streamed = False
        while not self.finished:
            item = await self._next(self.deadline)
            if isinstance(item, WorkerLeft):
                if item.worker_id not in self.watching:
                    continue  # a prefill worker that left after it answered
                raise WorkerFailure(
                    f"decode worker {worker} stopped while serving the request", "worker_lost"
                )
            if isinstance(item, PrefillResult):
                await self.d.release_stale(item)  # a late answer of a retried prefill
                continue
            if item.error is not None:
                if (
                    streamed
                    or len(tried) >= DECODE_ATTEMPTS
                    or item.error_code not in RETRYABLE_CODES
                ):
                    raise WorkerFailure(item.error, item.error_code)
                # The refusing worker dropped any KV lease, so the next one prefills locally.
                log.info("decode worker %s refused %s", worker, self.bus_id)
                self.kv = None
                worker = await self._send_decode(tried)
                continue
            _check_ending(item.finish_reason, worker)
            streamed = True
            if item.index not in self.choices.open:
                continue  # a choice the consumer stopped: what was under way is dropped
            if item.finish_reason is not None:
                self.choices.ended(item.index)
                self.finished = not self.choices.open
            # cached_tokens is set when this decode worker prefilled the prompt itself
            yield TokenEvent(
                list(item.token_ids),
                item.finish_reason,
                item.cached_tokens,
                item.index,
                item.logprobs,
                item.prompt_logprobs,
            )

    async def _send_decode(self, tried: set[str]) -> str:
        """Send the request to a decode worker not in ``tried`` (and add it there)."""
        # Most requests stop long before max_tokens (which for chat defaults to the whole
        # context), so the load estimate counts only a typical output length.
        expected = len(self.prompt) + min(self.sampling.max_tokens, TYPICAL_OUTPUT_TOKENS)
        worker = self.d.router.pick_decode(expected, tried, self.bus_id)
        if worker is None:
            if self.output:  # the client has its first token: this is now a failure
                raise WorkerFailure("no decode worker can take the request", "no_worker")
            raise NoWorker("no decode worker can take the request")
        tried.add(worker)
        self.watching = {worker}
        self._annotate("pdserve.decode_worker", worker)
        await self.d.send_decode(
            worker,
            DecodeRequest(
                request_id=self.bus_id,
                prompt_token_ids=self.prompt,
                output_token_ids=self.output,
                sampling=self.sampling,
                kv=self.kv,
                reply_to=self.d.inbox,
                deadline=self.deadline,
                client_request_id=self.client_id,
            ),
            self.headers,
        )
        return worker


def _check_ending(finish_reason: str | None, worker_id: str) -> None:
    """Only "stop" and "length" are a normal end; a worker-side abort or error without a
    message must still reach the client as an error, never as a short successful answer."""
    if finish_reason not in (None, "stop", "length"):
        raise WorkerFailure(
            f"worker {worker_id} ended the request ({finish_reason})", finish_reason
        )
