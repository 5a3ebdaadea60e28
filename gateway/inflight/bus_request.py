"""One request in flight on the bus, from the gateway's side: its ids, deadlines, queue, stage
and decode legs, and the two stages it goes through. ``BusRequest`` holds that state and reaches
the rest of the gateway only through its ``RequestPort`` (``port.py``). The ``Dispatcher``
(``dispatcher.py``) creates it, routes its workers' answers to its queue (``Departures`` adds the
departure of a worker it waits on, a reconnect of the bus), drives the stages and ends it.

``prefill()`` (``prefill_stage.py``) sends the prompt to a prefill worker (retrying elsewhere
when one refuses or vanishes) and returns the first token with the KV handle. ``decode()`` sends
the first leg (``legs.py``) - with that handle, or without one to have the decode worker prefill
locally - and yields the tokens its worker streams back. A worker that refuses a leg before its
first token hands it to another. A worker lost mid-stream, or whose tokens the bus lost
(``stream_check.py``), has its legs migrated: re-sent to live decode workers with the tokens the
client already has, from which they continue exactly (``legs.py``). The whole life cycle, step
by step: ``gateway/inflight/__init__.py``.

Deadlines follow progress, not the wall clock: a long answer that keeps streaming is never cut
off. The first token is due within ``--first-token-timeout`` of arrival (queues, prefill, KV
pull), each later token within ``--stall-timeout`` of the one before, and the first token of a
leg re-sent to another decode worker within ``--first-token-timeout`` again (it prefills prompt
+ delivered tokens); ``--request-timeout`` caps the whole request only where the operator sets
it. A request past its deadline ends with a timeout (504, or an error event mid-stream) and is
cancelled on its workers. Workers enforce a request's ``deadline`` only until its first token
(``services/worker_base.py``): past that, only the gateway judges a stall.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.gateway.inflight import legs, stream_check
from pdserve.gateway.inflight.delivery import Delivered, OpenChoices, TokenEvent
from pdserve.gateway.inflight.faults import NoWorker, StageTimeout, WorkerFailure, check_ending
from pdserve.gateway.inflight.legs import (
    MIGRATE_BUS_RECONNECT,
    MIGRATE_WHY,
    MIGRATE_WORKER_LOST,
    Leg,
)
from pdserve.gateway.inflight.limits import (
    DECODE_ATTEMPTS,
    PREFILL_ATTEMPTS,
    RETRYABLE_CODES,
    Limits,
    due_in,
    on_wire,
)
from pdserve.gateway.inflight.port import RequestPort
from pdserve.gateway.inflight.prefill_stage import PrefillStage
from pdserve.gateway.inflight.queue_items import (
    BusReconnected,
    CheckDue,
    Item,
    WorkerLeft,
    WorkerRejoined,
    next_item,
)
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.request_messages import PrefillResult
from pdserve.shared.bus.stream_messages import TokenItem
from pdserve.shared.kv.layout import layout_id
from pdserve.shared.sampling import SamplingParams

log = logging.getLogger(__name__)

KV_REPREFILL = "kv_reprefill"  # a decode worker's failed pull, to prefill again (reprefill)


class BusRequest(PrefillStage):
    """One request on the bus: created by ``Dispatcher.generate``, which drives its stages."""

    def __init__(
        self,
        *,
        port: RequestPort,
        limits: Limits,
        client_id: str,
        bus_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        context: Context | None,
        headers: dict[str, str],
        choices: OpenChoices | None = None,
        lora: str | None = None,
    ) -> None:
        self.port = port
        self.lora = lora  # the LoRA adapter both workers apply (None: the base model)
        self.limits = limits
        self.client_id = client_id  # the client's x-request-id: names the request on spans
        self.bus_id = bus_id  # unique: names it on the bus (see new_bus_id), and its first leg
        self.prompt = prompt
        self.sampling = sampling
        self.context = context
        self.headers = headers
        self.cap = due_in(limits.request_timeout)  # --request-timeout, if set
        # when the next progress is due while no leg is on a decode worker (prefill, between
        # legs); legs keep their own (``Leg.due``)
        self.due = due_in(limits.first_token_timeout)
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.prefill_worker: str | None = None  # the one it waits on, during an attempt
        self.stage = "route"
        self.kv: KVHandle | None = None
        self.finished = False  # ended normally: nothing to cancel on the workers
        self.choices = choices or OpenChoices(sampling.n)
        self.choices.bind(self._cancel_choice)
        self.delivered = Delivered(self.choices)  # what the consumer has: what migrations replay
        self.legs: dict[str, Leg] = {}  # by bus id: the DecodeRequests in flight
        self.migrations = 0
        self.reprefills = 0  # prefills again after a failed KV pull (``reprefill``)

    # -- the dispatcher's side ---------------------------------------------------------------

    def put(self, item: Item) -> None:
        self.queue.put_nowait(item)

    @property
    def watching(self) -> set[str]:
        """The workers whose departure or reconnect concerns it: its prefill or decode workers."""
        workers = {leg.worker for leg in self.legs.values()}
        return workers | {self.prefill_worker} if self.prefill_worker else workers

    @property
    def deadline(self) -> float:
        """What every wait is bounded by: the total cap, and the earliest progress due - of the
        legs on decode workers, or the request's own while it has none."""
        dues = [leg.due for leg in self.legs.values()] or [self.due]
        return min(self.cap, *dues)

    def progressed(self) -> None:
        """A token came: the next one is due within --stall-timeout."""
        self.due = due_in(self.limits.stall_timeout)

    async def _next(self, deadline: float) -> Item:
        item = await next_item(self.queue, deadline)
        if item is None:
            raise StageTimeout(self._overdue(deadline))
        return item

    def _overdue(self, deadline: float) -> str:
        """Why a wait that ended at ``deadline`` timed out, naming the option that set it."""
        if deadline >= self.cap:
            limit = "request"
        elif deadline < self.deadline:
            limit = "prefill"
        else:
            late = [leg for leg in self.legs.values() if leg.due <= deadline]
            streamed = late[0].streamed if late else self.delivered.has_tokens()
            limit = "stall" if streamed else "first_token"
        return self.limits.overdue(limit, self.stage)

    # -- decode --------------------------------------------------------------------------------

    async def decode(self) -> AsyncIterator[TokenEvent]:
        """Yield the tokens of decode workers until the request finishes. A worker that refuses
        before its first token (full or draining) hands its leg to another; a worker that is
        lost, or whose tokens the bus lost (``stream_check.py``), has its legs migrated
        (``legs.py``). After a NATS reconnect (ours, or the worker's) the legs it may concern are
        checked."""
        self.stage = "decode"
        first = Leg(
            bus_id=self.bus_id,
            index=None,
            output=list(self.delivered.tokens[0]),
            sampling=self.sampling,
            kv=self.kv,
        )
        await self._send_first(first)
        while not self.finished:
            item = await self._next(self.deadline)
            if isinstance(item, WorkerRejoined):  # (a WorkerLeft to a prefill)
                self._check(leg for leg in self.legs.values() if leg.worker == item.worker_id)
            elif isinstance(item, WorkerLeft):
                lost = [leg for leg in self.legs.values() if leg.worker == item.worker_id]
                await self._migrate(lost, MIGRATE_WORKER_LOST)  # (none: nothing to do)
            elif isinstance(item, BusReconnected):
                self._check(leg for leg in self.legs.values() if leg.epoch < item.epoch)
            elif isinstance(item, CheckDue):
                leg = self.legs.get(item.bus_id)
                if leg is not None and stream_check.check_due(
                    leg, self.port.outbox.check_stream, self.put
                ):
                    log.warning("%s: no answer from %s to a stream check", leg.bus_id, leg.worker)
                    await self._migrate([leg], MIGRATE_BUS_RECONNECT)
            elif isinstance(item, PrefillResult):
                if self._streams_from(item):  # the first token of the prompt being pulled
                    event = self._streamed_first(item)
                    if event is not None:
                        yield event
                else:
                    await self.port.outbox.release_stale(item)  # a late answer of a retried prefill
            elif (leg := self.legs.get(item.bus_id)) is not None:
                verdict = stream_check.screen(leg, item, self.choices.open, self.delivered.tokens)
                if verdict is None:
                    event = await self._on_item(leg, item)
                    if event is not None:
                        yield event
                elif verdict == stream_check.GAP:
                    self._check([leg])  # its worker sends again what it sent lately
                elif verdict != stream_check.SKIP:
                    log.warning("%s lost tokens from %s: %s", leg.bus_id, leg.worker, verdict)
                    await self._migrate([leg], MIGRATE_BUS_RECONNECT)
            # else: a late item of a leg migrated away (its worker is gone): dropped

    async def _on_item(self, leg: Leg, item: TokenItem) -> TokenEvent | None:
        if item.error is not None:
            if item.error_code == KV_REPREFILL:
                return await self._after_failed_pull(leg, item.error)
            retry = not leg.streamed and len(leg.tried) < DECODE_ATTEMPTS
            if not retry or item.error_code not in RETRYABLE_CODES:
                raise WorkerFailure(item.error, item.error_code)
            # The refusing worker dropped any KV lease, so the next one prefills locally.
            log.info("decode worker %s refused %s", leg.worker, leg.bus_id)
            leg.kv = None
            if leg.index is None:  # a streamed leg's first token may have come meanwhile
                leg.output = list(self.delivered.tokens[0])
            await self._send_first(leg)
            return None
        check_ending(item.finish_reason, leg.worker)
        leg.streamed = True
        if item.token_ids:  # progress: the next token is due within --stall-timeout
            leg.due = due_in(self.limits.stall_timeout)
            self.progressed()
        event = self.delivered.item(leg.choice(item.index), item)
        if event is not None and item.finish_reason is not None:
            self.finished = not self.choices.open
            if leg.index is not None:  # its one choice is over, and its worker is done with it
                self._drop_leg(leg, cancel=False)
        return event

    async def _after_failed_pull(self, leg: Leg, error: str) -> TokenEvent | None:
        """The decode worker of the first leg could not pull its KV and asks for it to be
        prefilled again (``--kv-failure-policy reprefill``): elsewhere, then a new first leg
        (``PrefillStage.reprefill``). A leg that streamed, or a request that tried this
        ``PREFILL_ATTEMPTS`` times already, fails as under policy fail."""
        failed = leg.kv.worker_id if leg.kv is not None else None
        if failed is None or leg.streamed or leg.index is not None:
            raise WorkerFailure(error, "kv_transfer")
        if self.reprefills >= PREFILL_ATTEMPTS:
            raise WorkerFailure(error, "kv_transfer")
        self._drop_leg(leg, cancel=False)  # its worker ended it
        self.port.routes.register(self.bus_id, self)  # the new prefill answers to the request
        event = await self.reprefill(failed)
        self.stage = "decode"
        if event is not None and not self.choices.open:
            return event  # finished at its first token: no decode leg
        first = Leg(
            bus_id=self.bus_id,
            index=None,
            output=list(self.delivered.tokens[0]),
            sampling=self.sampling,
            kv=self.kv,
        )
        await self._send_first(first)
        return event

    async def _send_first(self, leg: Leg) -> None:
        """Send ``leg`` to a decode worker it has not tried yet: the request's first leg, or a
        leg that a worker refused before its first token."""
        if not await self._send_leg(leg, await self.port.departures.recovered(self.deadline)):
            if self.delivered.has_tokens():  # the client has tokens: this is now a failure
                raise WorkerFailure("no decode worker can take the request", "no_worker")
            raise NoWorker("no decode worker can take the request")

    async def _send_leg(self, leg: Leg, skip: set[str]) -> bool:
        """Send ``leg`` to the decode worker the router picks, not one in ``leg.tried`` or
        ``skip``. False when there is none."""
        expected = leg.expected_tokens(len(self.prompt))
        layout = layout_id(leg.kv.fingerprint) if leg.kv is not None else ""
        if leg.kv is not None and leg.kv.streaming:
            skip = skip | self.port.router.not_streaming(layout)
        worker = self.port.router.pick_decode(
            expected, leg.tried | skip, leg.bus_id, layout, lora=self.lora
        )
        if worker is None:
            return False
        leg.tried.add(worker)
        leg.worker = worker
        leg.epoch = self.port.departures.bus_epoch
        # a new worker starts with a queue, a KV pull or a local prefill of prompt + output
        leg.due = due_in(self.limits.first_token_timeout)
        self.legs[leg.bus_id] = leg
        self.port.routes.register(leg.bus_id, self)
        trace.get_current_span(self.context).set_attribute("pdserve.decode_worker", worker)
        # the worker enforces the deadline only until its first token (services/worker_base.py)
        deadline = on_wire(min(self.cap, leg.due))
        msg = leg.request(self.prompt, self.port.outbox.inbox, deadline, self.client_id, self.lora)
        await self.port.outbox.send(worker, msg, self.headers)
        return True

    def _drop_leg(self, leg: Leg, cancel: bool) -> None:
        """``leg`` is over here: its worker finished it, or it is migrated away (``cancel``: so
        a worker that is not really gone frees its blocks). The request's own end drops the
        rest (``Dispatcher._tracking``)."""
        self.legs.pop(leg.bus_id, None)
        self.port.routes.unregister(leg.bus_id)
        if cancel:  # and again if its worker turns up while it might still run it
            self.port.departures.abandon(leg.worker, leg.bus_id, leg.abandoned_until(self.cap))

    def _cancel_choice(self, index: int) -> None:
        """The consumer stopped choice ``index`` (a stop string): stop it on its worker."""
        for leg in list(self.legs.values()):
            if leg.index == index:
                self._drop_leg(leg, cancel=True)
                return
            if leg.index is None:
                self.port.outbox.spawn(self.port.outbox.cancel(leg.bus_id, index))
                return
        self.port.outbox.spawn(self.port.outbox.cancel(self.bus_id, index))  # not in decode yet

    def _check(self, which: Iterable[Leg]) -> None:
        """Ask the workers of the legs ``which`` where their streams stand."""
        stream_check.check(
            which, self.port.outbox.check_stream, self.put, self.limits.worker_timeout
        )

    # -- migration ---------------------------------------------------------------------------

    async def _migrate(self, lost: list[Leg], reason: str) -> None:
        """Carry the open choices of the ``lost`` legs on, on live decode workers, from the
        tokens already delivered (``legs.py``); at most ``--max-migrations`` times a request."""
        old = sorted({leg.worker for leg in lost})
        carried: set[int] = set()
        for leg in lost:
            carried |= leg.carries(self.choices.open)
            self._drop_leg(leg, cancel=True)
        if not carried:
            return
        what = f"decode worker {', '.join(old)} " + MIGRATE_WHY[reason]
        limit = self.limits.max_migrations
        if self.migrations >= limit:
            raise WorkerFailure(
                f"{what}; migrated {self.migrations} time(s) already (--max-migrations {limit})",
                "worker_lost",
            )
        skip = await self.port.departures.recovered(self.deadline)
        self.migrations += 1
        sent = self.delivered.prompt_logprobs_sent
        plans = legs.replan(carried, self.delivered.tokens, self.sampling, sent)
        new: list[Leg] = []
        for index, output, sampling in plans:
            leg = Leg(
                bus_id=legs.new_bus_id(self.client_id),
                index=index,
                output=output,
                sampling=sampling,
            )
            if not await self._send_leg(leg, skip):
                raise WorkerFailure(f"{what}; no live decode worker to take it", "worker_lost")
            new.append(leg)
        self.port.count_migration(reason)
        legs.record_migration(
            self.client_id, self.bus_id, reason, old, new, self.migrations, limit, self.context
        )
