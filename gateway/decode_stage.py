"""The decode stage of a request in flight, and its migration when a decode worker is lost.

``DecodeStage.decode()`` sends the request's first leg (``gateway/legs.py``) - with the prefill
worker's KV handle, or without one to have the decode worker prefill locally - and yields the
tokens its worker streams back. A worker that refuses a leg before its first token (full,
draining) hands it to another. A worker that is lost mid-stream - ping-confirmed dead, gone
cleanly, restarted - or whose tokens were lost on the bus (a gap in their positions, or a check
after a NATS reconnect that finds the stream gone: ``gateway/stream_check.py``) has its legs
*migrated*: re-sent, under fresh bus ids, to live decode workers with the tokens the
client already has, which the new worker prefills and continues from exactly. The client's
stream goes on: no token is repeated, skipped or reordered (tokens are delivered only from the
live legs, and each continues from precisely what was delivered), and each choice ends once.

Limits: ``--max-migrations`` per request, and a live decode worker to go to; otherwise the stream
ends with the error it always did (``worker_lost``). Each migration is a log line naming both
workers, a ``pdserve.migration`` event on the request's span, and one count of
``pdserve_request_migrations_total{reason}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from opentelemetry import trace

from pdserve.gateway.inflight_types import (
    ABANDONED_STREAM_SECONDS,
    DECODE_ATTEMPTS,
    MIGRATE_BUS_RECONNECT,
    MIGRATE_WORKER_LOST,
    RETRYABLE_CODES,
    TYPICAL_OUTPUT_TOKENS,
    BusReconnected,
    CheckDue,
    NoWorker,
    TokenEvent,
    WorkerFailure,
    WorkerLeft,
    WorkerRejoined,
    check_ending,
    due_in,
    on_wire,
)
from pdserve.gateway.legs import Leg, new_bus_id, replan
from pdserve.gateway.stream_check import SKIP, StreamChecks
from pdserve.shared.bus.protocol import DecodeRequest, PrefillResult, TokenItem
from pdserve.shared.kv.layout import layout_id
from pdserve.shared.telemetry import tracing as tr

if TYPE_CHECKING:
    from pdserve.gateway.inflight import InFlight

log = logging.getLogger("pdserve.gateway.dispatch")


class DecodeStage(StreamChecks):
    """The decode side of ``InFlight`` (a mixin: the request object owns the state)."""

    async def decode(self: InFlight) -> AsyncIterator[TokenEvent]:
        """Yield the tokens of decode workers until the request finishes. A worker that refuses
        before its first token (full or draining) hands its leg to another; a worker that is
        lost, or whose tokens the bus lost, has its legs migrated (``legs.py``). After a NATS
        reconnect (ours, or the worker's) the legs it may concern are checked."""
        self.stage = "decode"
        self.listen(self.bus_id)
        first = Leg(self.bus_id, None, list(self.delivered[0]), self.sampling, self.kv)
        await self._send_first(first)
        while not self.finished:
            item = await self._next(self.deadline)
            if isinstance(item, WorkerRejoined):  # (a WorkerLeft to a prefill)
                self._check(leg for leg in self.legs.values() if leg.worker == item.worker_id)
            elif isinstance(item, WorkerLeft):
                lost = [leg for leg in self.legs.values() if leg.worker == item.worker_id]
                if lost:
                    await self._migrate(lost, MIGRATE_WORKER_LOST)
            elif isinstance(item, BusReconnected):
                self._check(leg for leg in self.legs.values() if leg.epoch < item.epoch)
            elif isinstance(item, CheckDue):
                if (leg := self._check_due(item)) is not None:
                    log.warning("%s: no answer from %s to a stream check", leg.bus_id, leg.worker)
                    await self._migrate([leg], MIGRATE_BUS_RECONNECT)
            elif isinstance(item, PrefillResult):
                await self.d.release_stale(item)  # a late answer of a retried prefill
            elif (leg := self.legs.get(item.bus_id)) is not None:
                if (lost := self._screen(leg, item)) is None:
                    event = await self._on_item(leg, item)
                    if event is not None:
                        yield event
                elif lost != SKIP:
                    log.warning("%s lost tokens from %s: %s", leg.bus_id, leg.worker, lost)
                    await self._migrate([leg], MIGRATE_BUS_RECONNECT)
            # else: a late item of a leg migrated away (its worker is gone): dropped

    async def _on_item(self: InFlight, leg: Leg, item: TokenItem) -> TokenEvent | None:
        if item.error is not None:
            if (
                leg.streamed
                or len(leg.tried) >= DECODE_ATTEMPTS
                or item.error_code not in RETRYABLE_CODES
            ):
                raise WorkerFailure(item.error, item.error_code)
            # The refusing worker dropped any KV lease, so the next one prefills locally.
            log.info("decode worker %s refused %s", leg.worker, leg.bus_id)
            leg.kv = None
            await self._send_first(leg)
            return None
        check_ending(item.finish_reason, leg.worker)
        leg.streamed = True
        if item.token_ids:  # progress: the next token is due within --stall-timeout
            leg.due = due_in(self.d.stall_timeout)
            self.progressed()
        index = leg.choice(item.index)
        if index not in self.choices.open:
            return None  # a choice the consumer stopped: what was under way is dropped
        self.delivered[index].extend(item.token_ids)
        if item.finish_reason is not None:
            self.choices.ended(index)
            self.finished = not self.choices.open
            if leg.index is not None:  # its one choice is over, and its worker is done with it
                self._drop_leg(leg, cancel=False)
        # cached_tokens: set when a decode worker prefilled the prompt itself (reported once,
        # not again by the local prefill of a migration); prompt log-probs likewise go out once
        cached, self.cached_reported = (
            (item.cached_tokens, True) if not self.cached_reported else (None, True)
        )
        prompt_logprobs = None if self.prompt_logprobs_sent else item.prompt_logprobs
        self.prompt_logprobs_sent |= prompt_logprobs is not None
        return TokenEvent(
            list(item.token_ids), item.finish_reason, cached, index, item.logprobs, prompt_logprobs
        )

    async def _send_first(self: InFlight, leg: Leg) -> None:
        """Send ``leg`` to a decode worker it has not tried yet: the request's first leg, or a
        leg that a worker refused before its first token."""
        if not await self._send_leg(leg, await self.d.recovered(self.deadline)):
            if any(self.delivered.values()):  # the client has tokens: this is now a failure
                raise WorkerFailure("no decode worker can take the request", "no_worker")
            raise NoWorker("no decode worker can take the request")

    async def _send_leg(self: InFlight, leg: Leg, skip: set[str]) -> bool:
        """Send ``leg`` to the decode worker the router picks, not one in ``leg.tried`` or
        ``skip``. False when there is none."""
        # Most requests stop long before max_tokens (which for chat defaults to the whole
        # context), so the load estimate counts only a typical output length.
        remaining = max(0, leg.sampling.max_tokens - len(leg.output))
        expected = len(self.prompt) + len(leg.output) + min(remaining, TYPICAL_OUTPUT_TOKENS)
        layout = layout_id(leg.kv.fingerprint) if leg.kv is not None else ""
        worker = self.d.router.pick_decode(expected, leg.tried | skip, leg.bus_id, layout)
        if worker is None:
            return False
        leg.tried.add(worker)
        leg.worker = worker
        leg.epoch = self.d.bus_epoch
        # a new worker starts with a queue, a KV pull or a local prefill of prompt + output
        leg.due = due_in(self.d.first_token_timeout)
        self.legs[leg.bus_id] = leg
        self.listen(leg.bus_id)
        self.watching = {other.worker for other in self.legs.values()}
        self._annotate("pdserve.decode_worker", worker)
        await self.d.send_decode(
            worker,
            DecodeRequest(
                bus_id=leg.bus_id,
                prompt_token_ids=self.prompt,
                output_token_ids=leg.output,
                sampling=leg.sampling,
                kv=leg.kv,
                reply_to=self.d.inbox,
                # the worker enforces it only until its first token (services/worker_base.py)
                deadline=on_wire(min(self.cap, leg.due)),
                client_id=self.client_id,
            ),
            self.headers,
        )
        return True

    def _drop_leg(self: InFlight, leg: Leg, cancel: bool) -> None:
        """``leg`` is over here: its worker finished it, or it is migrated away (``cancel``: so
        a worker that is not really gone frees its blocks)."""
        self.legs.pop(leg.bus_id, None)
        self.bus_ids.discard(leg.bus_id)
        self.d.unregister(leg.bus_id)
        self.watching = {other.worker for other in self.legs.values()}
        if cancel:
            # Cancelled again if its worker turns up, for as long as that worker might still
            # run it: until its deadline before its first token, for a while once streaming.
            if leg.streamed:
                until = time.time() + ABANDONED_STREAM_SECONDS
            else:
                until = min(self.cap, leg.due)
            self.d.abandon(leg.worker, leg.bus_id, until)

    def _cancel_choice(self: InFlight, index: int) -> None:
        """The consumer stopped choice ``index`` (a stop string): stop it on its worker."""
        for leg in list(self.legs.values()):
            if leg.index == index:
                self._drop_leg(leg, cancel=True)
                return
            if leg.index is None:
                self.d.spawn(self.d.cancel(leg.bus_id, index))
                return
        self.d.spawn(self.d.cancel(self.bus_id, index))  # not in decode yet

    # -- migration ---------------------------------------------------------------------------

    async def _migrate(self: InFlight, lost: list[Leg], reason: str) -> None:
        """Carry the open choices of the ``lost`` legs on, on live decode workers, from the
        tokens already delivered (``legs.py``); at most ``max_migrations`` times a request."""
        old = sorted({leg.worker for leg in lost})
        carried: set[int] = set()
        for leg in lost:
            carried |= self.choices.open if leg.index is None else {leg.index} & self.choices.open
            self._drop_leg(leg, cancel=True)
        if not carried:
            return
        what = f"decode worker {', '.join(old)} " + (
            "stopped while serving the request"
            if reason == MIGRATE_WORKER_LOST
            else "sent tokens that the bus lost"
        )
        limit = self.d.max_migrations
        if self.migrations >= limit:
            raise WorkerFailure(
                f"{what}; migrated {self.migrations} time(s) already (--max-migrations {limit})",
                "worker_lost",
            )
        skip = await self.d.recovered(self.deadline)
        self.migrations += 1
        plans = replan(carried, self.delivered, self.sampling, self.prompt_logprobs_sent)
        new: list[Leg] = []
        for index, output, sampling in plans:
            leg = Leg(new_bus_id(self.client_id), index, output, sampling)
            if not await self._send_leg(leg, skip):
                raise WorkerFailure(f"{what}; no live decode worker to take it", "worker_lost")
            new.append(leg)
        self._record_migration(reason, old, new)

    def _record_migration(self: InFlight, reason: str, old: list[str], new: list[Leg]) -> None:
        to = sorted({leg.worker for leg in new})
        tokens = sum(len(leg.output) for leg in new)
        log.warning(
            "migrated %s (%s) from decode worker %s to %s with %d delivered token(s) (%s; "
            "migration %d of at most %d)",
            self.client_id, self.bus_id, ",".join(old), ",".join(to), tokens, reason,
            self.migrations, self.d.max_migrations,
        )  # fmt: skip
        self.d.count_migration(reason)
        trace.get_current_span(self.context).add_event(
            tr.EVENT_MIGRATION,
            {
                tr.ATTR_MIGRATION_REASON: reason,
                tr.ATTR_MIGRATION_FROM: old,
                tr.ATTR_MIGRATION_TO: to,
                tr.ATTR_MIGRATION_TOKENS: tokens,
                tr.ATTR_MIGRATION_COUNT: self.migrations,
            },
        )
