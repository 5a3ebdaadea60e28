"""The prefill stage of a request in flight (``bus_request.py``): a prefill worker computes the
prompt's KV and samples the first token, which the client gets at once.

Layer-wise KV streaming (issue 29 item 3; the worker's side: ``services/prefill/worker.py``): a
prefill worker may answer twice: first, when the prompt's last forward pass starts, with the
handle of KV it is still computing and no token (``streamed``); then as always, with the first
token. On the first answer the request leaves the prefill stage: its decode leg goes at once,
without a token, to a decode worker that pulls streamed KV, which then pulls each layer group
as prefill writes it and gets the first token with the last piece. The second answer still
brings the client its first token at once (``_streamed_first``). From the first answer on, the
leg owns the request: a prefill that fails after it is not retried elsewhere - the decode
worker's pull is refused, and its ``--kv-failure-policy`` recomputes the prompt (its first token
included) or fails the request. Where no decode worker can stream, the first answer is ignored
and the request waits for the whole prefill, pulled in bulk as before.

A decode worker under ``--kv-failure-policy reprefill`` hands a failed pull back instead
(``kv_reprefill``, before it streamed a token): ``reprefill`` prefills the prompt again on
another prefill worker (never the one whose KV could not be pulled, which is likely dead), and
the request's first leg goes out again with the new KV - or without KV, prefilled on a decode
worker, where no other prefill worker is left. A first token the client already has (the dead
worker's, identical for greedy or seeded sampling) is not sent again: the new leg continues from
it, as a migrated one does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.gateway.inflight.delivery import Delivered, OpenChoices, TokenEvent
from pdserve.gateway.inflight.faults import WorkerFailure, check_ending
from pdserve.gateway.inflight.limits import (
    PREFILL_ATTEMPTS,
    RETRYABLE_CODES,
    Limits,
    due_in,
    on_wire,
)
from pdserve.gateway.inflight.port import RequestPort
from pdserve.gateway.inflight.queue_items import BusReconnected, Item, WorkerLeft
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.request_messages import PrefillRequest, PrefillResult
from pdserve.shared.kv.layout import chain_root, layout_id
from pdserve.shared.sampling import SamplingParams

log = logging.getLogger(__name__)


def streamed(result: PrefillResult) -> bool:
    """A prefill worker's early answer: the handle of KV it is still computing (leased when the
    prompt's last forward pass started), no token yet (``services/prefill/worker.py``)."""
    return (
        result.error is None
        and result.first_token is None
        and result.kv is not None
        and result.kv.streaming
    )


class PrefillStage:
    if TYPE_CHECKING:  # the request's own state (``BusRequest``)
        port: RequestPort
        limits: Limits
        client_id: str
        lora: str | None
        bus_id: str
        prompt: list[int]
        sampling: SamplingParams
        context: Context | None
        headers: dict[str, str]
        stage: str
        due: float
        reprefills: int
        prefill_worker: str | None
        kv: KVHandle | None
        delivered: Delivered
        finished: bool
        choices: OpenChoices

        @property
        def deadline(self) -> float: ...
        def progressed(self) -> None: ...
        async def _next(self, deadline: float) -> Item: ...

    # -- prefill -----------------------------------------------------------------------------

    async def prefill(self, exclude: frozenset[str] = frozenset()) -> TokenEvent | None:
        """Prefill on a prefill worker, not one in ``exclude``. Returns the first token's event,
        or None when no prefill worker could take the request (a decode worker then prefills it
        locally) or the client has its first token already (``reprefill``)."""
        self.stage = "prefill"
        tried: set[str] = set(exclude)
        for _ in range(PREFILL_ATTEMPTS):
            skip = tried | await self.port.departures.recovered(self.deadline)
            root = chain_root(self.sampling.cache_salt)  # a salted prompt hits its own chain only
            worker = self.port.router.pick_prefill(
                self.prompt, skip, self.bus_id, root=root, lora=self.lora
            )
            if worker is None:
                return None
            tried.add(worker)
            result = await self._prefill_on(worker)
            if result is None:
                continue  # it left: prefill is idempotent, so try another
            if streamed(result):  # the decode leg pulls its KV as it is computed
                self.kv = result.kv
                return None
            if result.error is None:
                return self._first_token(result)
            if result.error_code in RETRYABLE_CODES:
                log.info("prefill worker %s refused %s: %s", worker, self.bus_id, result.error)
                continue
            raise WorkerFailure(f"prefill failed: {result.error}", result.error_code)
        # Every prefill worker we tried refused or vanished: a decode worker can still prefill.
        return None

    async def _prefill_on(self, worker: str) -> PrefillResult | None:
        """Send the prompt to ``worker`` (just picked) and wait for its answer; None if it left
        meanwhile (or our bus connection broke, which may have lost the request or its answer).
        However it ends, the prompt stops counting as work queued on that worker."""
        try:
            self.prefill_worker = worker
            trace.get_current_span(self.context).set_attribute("pdserve.prefill_worker", worker)
            deadline = min(self.deadline, time.time() + self.limits.prefill_timeout)
            epoch = self.port.departures.bus_epoch
            msg = PrefillRequest(
                bus_id=self.bus_id,
                prompt_token_ids=self.prompt,
                sampling=self.sampling,
                reply_to=self.port.outbox.inbox,
                deadline=on_wire(deadline),
                client_id=self.client_id,
                stream_kv=self.port.router.can_stream(),
                lora=self.lora,
            )
            await self.port.outbox.send(worker, msg, self.headers)
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
                    if streamed(item) and not self._streamable(item.kv):
                        continue  # no decode worker can take it now: wait for all of it
                    return item
                else:
                    # a late answer of an earlier attempt
                    await self.port.outbox.release_stale(item)
        finally:
            self.prefill_worker = None
            self.port.router.prefill_done(self.bus_id)

    async def reprefill(self, failed: str) -> TokenEvent | None:
        """Prefill again, elsewhere than on ``failed``, the prompt whose KV the decode worker
        could not pull from it; sets ``kv`` for the next first leg (None: prefill locally)."""
        self.reprefills += 1
        self.kv = None
        self.due = due_in(self.limits.first_token_timeout)  # a new prefill, queue and pull
        log.warning("prefilling %s again: its KV could not be pulled from %s", self.bus_id, failed)
        event = await self.prefill(frozenset({failed}))
        log.warning("prefilled %s again on %s", self.bus_id, self.kv.worker_id if self.kv else "-")
        return event

    def _first_token(self, result: PrefillResult) -> TokenEvent | None:
        check_ending(result.finish_reason, result.worker_id)
        if self.delivered.tokens[0]:  # a reprefill: the client has it, the next leg follows it
            self.kv = dataclasses.replace(result.kv, streaming=False) if result.kv else None
            return None
        if result.first_token is not None:
            self.progressed()
        event = self.delivered.first_token(result)
        if self.choices.open:
            # complete now: any decode worker pulls it in bulk, with the token in the request
            self.kv = dataclasses.replace(result.kv, streaming=False) if result.kv else None
        else:
            self.finished = True
            self.port.outbox.spawn(self.port.outbox.release_stale(result))  # its KV is not needed
        return event

    def _streamable(self, kv: KVHandle) -> bool:
        """Whether a decode worker can pull ``kv`` while it is prefilled (else the request
        waits for the whole prefill and any decode worker pulls it in bulk)."""
        return self.port.router.can_stream(layout_id(kv.fingerprint))

    def _streams_from(self, result: PrefillResult) -> bool:
        """Whether ``result`` is the prefill answer for the KV the first leg pulls as it is
        computed (its first token; or why it never came - the leg's pull then fails)."""
        kv = self.kv
        return (
            kv is not None
            and kv.streaming
            and result.bus_id == self.bus_id
            and result.worker_id == kv.worker_id
        )

    def _streamed_first(self, result: PrefillResult) -> TokenEvent | None:
        """The prefill worker's first token, while the decode worker pulls the KV: the client
        gets it now. An error is the decode worker's to handle (its pull is refused: it fails
        or recomputes); a first token that a recomputing decode worker delivered already is
        not sent twice."""
        if result.error is not None:
            log.info("prefill of streamed %s failed: %s", self.bus_id, result.error)
            return None
        if self.delivered.tokens[0]:
            return None
        check_ending(result.finish_reason, result.worker_id)
        self.progressed()
        event = self.delivered.first_token(result)
        if not self.choices.open:  # finished at the first token: the decode leg is refused
            self.finished = True
            self.port.outbox.spawn(self.port.outbox.cancel(self.bus_id))
        return event
