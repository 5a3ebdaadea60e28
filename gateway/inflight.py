"""One request in flight on the bus, from the gateway's side: its ids, deadlines, inbox queue
and stage, and the two stages it goes through.

``InFlight.prefill()`` sends the prompt to a prefill worker (retrying elsewhere when one refuses
or vanishes) and returns the first token with the KV handle; ``InFlight.decode()`` sends the
request - with that handle, or without one to have the decode worker prefill it locally - to a
decode worker and yields its tokens, moving on to another decode worker when one refuses before
its first token. Every wait is bounded by the request's deadline; the dispatcher feeds the
queue (worker answers, the departure of a worker this request is waiting on, a reconnect of the
bus).

Deadlines follow progress, not the wall clock: a long answer that keeps streaming is never cut
off. The first token is due within ``--first-token-timeout`` of arrival (queues, prefill, KV
pull), each later token within ``--stall-timeout`` of the one before, and the first token of a
leg re-sent to another decode worker within ``--first-token-timeout`` again (it prefills prompt
+ delivered tokens); ``--request-timeout`` caps the whole request only where the operator sets
it. A request past its deadline ends with a timeout (504, or an error event mid-stream) and is
cancelled on its workers. Workers enforce a request's ``deadline`` only until its first token
(``services/worker_base.py``): past that, only the gateway judges a stall.

The decode stage lives in ``gateway/decode_stage.py``: a decode worker lost mid-stream does not
fail the request there, its DecodeRequests ("legs", ``gateway/legs.py``) are migrated - re-sent
to live decode workers with the tokens the client already has, which the new worker prefills and
continues from exactly - up to ``--max-migrations`` times a request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.gateway.decode_stage import DecodeStage
from pdserve.gateway.inflight_types import (
    DECODE_ATTEMPTS,
    DEFAULT_MAX_MIGRATIONS,
    MIGRATE_BUS_RECONNECT,
    MIGRATE_WORKER_LOST,
    PREFILL_ATTEMPTS,
    RETRYABLE_CODES,
    TYPICAL_OUTPUT_TOKENS,
    BusReconnected,
    Choices,
    Item,
    NotSendable,
    NoWorker,
    StageTimeout,
    TokenEvent,
    WorkerFailure,
    WorkerLeft,
    check_ending,
    due_in,
    on_wire,
)
from pdserve.gateway.legs import Leg
from pdserve.shared.bus.protocol import KVHandle, PrefillRequest, PrefillResult
from pdserve.shared.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.gateway.dispatch import Dispatcher

__all__ = [
    "DECODE_ATTEMPTS",
    "DEFAULT_MAX_MIGRATIONS",
    "MIGRATE_BUS_RECONNECT",
    "MIGRATE_WORKER_LOST",
    "PREFILL_ATTEMPTS",
    "RETRYABLE_CODES",
    "TYPICAL_OUTPUT_TOKENS",
    "BusReconnected",
    "Choices",
    "InFlight",
    "NoWorker",
    "NotSendable",
    "StageTimeout",
    "TokenEvent",
    "WorkerFailure",
    "WorkerLeft",
]

log = logging.getLogger("pdserve.gateway.dispatch")


class InFlight(DecodeStage):
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
        self.bus_id = bus_id  # unique: names it on the bus (see new_bus_id), and its first leg
        self.prompt = prompt
        self.sampling = sampling
        self.context = context
        self.headers = headers
        cap = dispatcher.request_timeout
        self.cap = time.time() + cap if cap > 0 else math.inf  # --request-timeout, if set
        # when the next progress is due while no leg is on a decode worker (prefill, between
        # legs); legs keep their own (``Leg.due``)
        self.due = due_in(dispatcher.first_token_timeout)
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.watching: set[str] = set()  # workers whose departure should wake this request
        self.stage = "route"
        # tokens handed to the consumer, by choice: what a migration replays
        self.delivered: dict[int, list[int]] = defaultdict(list)
        self.kv: KVHandle | None = None
        self.finished = False  # ended normally: nothing to cancel on the workers
        self.choices = choices or Choices(sampling.n)
        self.choices.bind(self._cancel_choice)
        self.legs: dict[str, Leg] = {}  # by bus id: the DecodeRequests in flight
        self.bus_ids: set[str] = set()  # every id the dispatcher routes to this request
        self.migrations = 0
        self.prompt_logprobs_sent = False
        self.cached_reported = False

    # -- the dispatcher's side ---------------------------------------------------------------

    def put(self, item: Item) -> None:
        self.queue.put_nowait(item)

    def worker_left(self, worker_id: str) -> None:
        if worker_id in self.watching:
            self.put(WorkerLeft(worker_id))

    def listen(self, bus_id: str) -> None:
        """Have the dispatcher route messages for ``bus_id`` here."""
        self.bus_ids.add(bus_id)
        self.d.register(bus_id, self)

    def close(self) -> set[str]:
        """The request is over: stop routing to it. Returns the ids it still had on the bus."""
        ids, self.bus_ids = self.bus_ids, set()
        for bus_id in ids:
            self.d.unregister(bus_id)
        return ids

    @property
    def deadline(self) -> float:
        """What every wait is bounded by: the total cap, and the earliest progress due - of the
        legs on decode workers, or the request's own while it has none."""
        dues = [leg.due for leg in self.legs.values()] or [self.due]
        return min(self.cap, *dues)

    def progressed(self) -> None:
        """A token came: the next one is due within --stall-timeout."""
        self.due = due_in(self.d.stall_timeout)

    async def _next(self, deadline: float) -> Item:
        remaining = deadline - time.time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            if not self.queue.empty():  # already here: no timer and no task to wait
                return self.queue.get_nowait()
            if math.isinf(remaining):
                return await self.queue.get()  # every limit is off
            return await asyncio.wait_for(self.queue.get(), remaining)
        except asyncio.TimeoutError:
            raise StageTimeout(self._overdue(deadline)) from None

    def _overdue(self, deadline: float) -> str:
        """Why a wait that ended at ``deadline`` timed out, naming the option that set it."""
        d = self.d
        if deadline >= self.cap:
            why = f"the request took longer than --request-timeout ({d.request_timeout:g} s)"
        elif deadline < self.deadline:
            why = f"the stage passed its --prefill-timeout ({d.prefill_timeout:g} s)"
        else:
            legs = [leg for leg in self.legs.values() if leg.due <= deadline]
            if legs[0].streamed if legs else any(self.delivered.values()):
                why = f"no new token for --stall-timeout ({d.stall_timeout:g} s)"
            else:
                why = f"no first token within --first-token-timeout ({d.first_token_timeout:g} s)"
        return f"{why} in the {self.stage} stage"

    def _annotate(self, key: str, worker_id: str) -> None:
        trace.get_current_span(self.context).set_attribute(key, worker_id)

    # -- prefill -----------------------------------------------------------------------------

    async def prefill(self) -> TokenEvent | None:
        """Prefill on a prefill worker. Returns the first token's event, or None when no prefill
        worker could take the request (a decode worker then prefills it locally)."""
        self.stage = "prefill"
        tried: set[str] = set()
        for _ in range(PREFILL_ATTEMPTS):
            skip = tried | await self.d.recovered(self.deadline)
            worker = self.d.router.pick_prefill(self.prompt, exclude=skip, bus_id=self.bus_id)
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
        """Send the prompt to ``worker`` and wait for its answer; None if it left meanwhile (or
        our bus connection broke, which may have lost the request or its answer)."""
        self.watching.add(worker)
        self._annotate("pdserve.prefill_worker", worker)
        deadline = min(self.deadline, time.time() + self.d.prefill_timeout)
        epoch = self.d.bus_epoch
        try:
            await self.d.send_prefill(
                worker,
                PrefillRequest(
                    bus_id=self.bus_id,
                    prompt_token_ids=self.prompt,
                    sampling=self.sampling,
                    reply_to=self.d.inbox,
                    deadline=on_wire(deadline),
                    client_id=self.client_id,
                ),
                self.headers,
            )
            while True:
                item = await self._next(deadline)
                if isinstance(item, WorkerLeft):
                    if item.worker_id == worker:
                        log.warning("prefill worker %s left; retrying %s", worker, self.bus_id)
                        return None
                elif isinstance(item, BusReconnected):
                    if item.epoch > epoch:
                        log.warning("bus reconnected during the prefill of %s", self.bus_id)
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
        check_ending(result.finish_reason, result.worker_id)
        if result.first_token is not None:
            self.delivered[0].append(result.first_token)
            self.progressed()
        if result.finish_reason is not None:
            self.choices.ended(0)  # done at the first token (max_tokens=1, EOS, ...)
        if self.choices.open:
            self.kv = result.kv
        else:
            self.finished = True
            self.d.spawn(self.d.release_stale(result))  # its KV is not needed
        self.prompt_logprobs_sent = result.prompt_logprobs is not None
        self.cached_reported = True
        return TokenEvent(
            list(self.delivered[0]),
            result.finish_reason,
            result.cached_tokens,
            logprobs=result.first_logprobs,
            prompt_logprobs=result.prompt_logprobs,
        )
