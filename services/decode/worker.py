"""The decode worker: pulls a prefilled request's KV, then generates in the continuous batch.

For a ``DecodeRequest`` with a KV handle the worker reserves blocks in its own cache, pulls the
prefill worker's blocks straight into them over UCX, tells the prefill worker to drop its lease,
and activates the sequence in the running batch. Without a handle (short prompt, no prefill
worker alive, aggregated mode) it prefills locally. After every engine step it publishes one
``TokenBatch`` per gateway inbox with every token that step produced for that inbox.

A failed pull follows ``--kv-failure-policy``: ``fail`` ends the request with an error item (never
text), ``recompute`` prefills it here instead.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import deque
from dataclasses import dataclass

from services.engine.engine import LLMEngine
from services.probe import pull_probe
from services.worker_base import RequestState, Step, Worker, exit_now, record_prefill_forward
from shared import tracing, ucx_check
from shared.kv_probe import ProbePullRequest, answer_probes
from shared.kv_transfer import KVClient, KVTransferError
from shared.protocol import (
    DecodeRequest,
    ReleaseLease,
    TokenBatch,
    TokenItem,
    WorkerGone,
    WorkerLoad,
)

log = logging.getLogger("pdserve.decode")

PULL_TIMEOUT = 30.0  # one request's KV pull, beyond which it counts as failed


@dataclass
class DecodeState(RequestState):
    num_output_tokens: int = 0
    first_step_ns: int | None = None  # first decode step (start of decode.generate)
    pulling: bool = False
    cancelled: bool = False  # cancel/deadline while the pull writes into our blocks
    local_prefill: bool = False  # prefilled here: its first item reports the cached tokens


class DecodeWorker(Worker):
    role = "decode"
    service_name = tracing.SERVICE_DECODE

    def __init__(self, ns: argparse.Namespace | dict) -> None:
        super().__init__(ns)
        self.kv_client: KVClient | None = None
        self.kv_servers: dict[str, str] = {}  # prefill worker id -> KV address connected to
        # requests whose blocks could not be reserved yet (cache full), oldest first
        self.admission: deque[tuple[DecodeRequest, DecodeState]] = deque()

    def make_engine(self) -> LLMEngine:
        return LLMEngine(self.engine_config)

    async def start_extra(self) -> None:
        self.kv_client = KVClient(
            self.engine.kv_cache,
            self.engine.layout_fingerprint(),
            self.engine.block_size,
            host=self.config.ucx_host,
            port=self.config.ucx_port,
        )
        self.kv_client.own_address()  # configure UCX now: a bad --ucx-host fails at start-up
        ucx_check.warn_at_startup(self.role)  # RDMA/GPUs UCX cannot use: TCP would carry KV

    async def close_extra(self) -> None:
        if self.kv_client is not None:
            await self.kv_client.close()

    async def subscribe(self) -> None:
        await self.bus.subscribe(
            self.subjects.decode(self.worker_id), self._on_request, (DecodeRequest,)
        )
        await self.bus.subscribe(
            self.subjects.loads_of("prefill"), self._on_prefill_load, (WorkerLoad, WorkerGone)
        )
        await answer_probes(
            self.bus, self.worker_id, (ProbePullRequest,), lambda req: pull_probe(self, req)
        )

    async def _on_prefill_load(
        self, load: WorkerLoad | WorkerGone, headers: dict[str, str]
    ) -> None:
        """Connect to a prefill worker when it first shows up, so the first pull does not pay
        for the endpoint (tens of ms); let the endpoint go when the worker says it left."""
        if isinstance(load, WorkerGone):
            address = self.kv_servers.pop(load.worker_id, None)
            if address is not None:
                self.kv_client.disconnect(address)
            return
        if load.ucx_address and self.kv_servers.get(load.worker_id) != load.ucx_address:
            self.kv_servers[load.worker_id] = load.ucx_address
            self.spawn(self._connect(load.worker_id, load.ucx_address))

    async def _connect(self, worker_id: str, address: str) -> None:
        try:
            await self.kv_client.connect(address)
        except Exception as exc:  # the pull will try again and report properly
            log.info("could not pre-connect to %s: %r", worker_id, exc)

    def load_extra(self) -> dict:
        return {"local_prefill_threshold": self.config.local_prefill_threshold}

    def load(self):
        load = super().load()
        load.waiting += len(self.admission)
        return load

    # -- requests ------------------------------------------------------------------------------

    async def _on_request(self, req: DecodeRequest, headers: dict[str, str]) -> None:
        if not self.reply_ok(req.reply_to):
            log.warning(
                "dropping %s: reply subject %r is not a gateway inbox", req.request_id, req.reply_to
            )
            return
        if self.was_cancelled(req.request_id):  # the gateway gave up on it already
            if req.kv is not None:
                await self._release_lease(req)
            return
        refusal = self._refusal(req)
        if refusal is not None:
            await self._fail_request(req.reply_to, req.request_id, *refusal)
            if req.kv is not None and refusal[0] != "invalid":
                await self._release_lease(req)  # the prefill worker's blocks are of no use now
            return
        state = DecodeState(
            req.request_id, req.reply_to, req.deadline, tracing.extract_context(headers)
        )
        state.num_prompt_tokens = len(req.prompt_token_ids)
        state.client_request_id = req.client_request_id
        self.states[req.request_id] = state
        if req.kv is None:
            self._prefill_locally(req, state)
        else:
            self._admit_pull(req, state)

    def _refusal(self, req: DecodeRequest) -> tuple[str, str] | None:
        if self.draining:
            return "draining", f"decode worker {self.worker_id} is draining"
        if req.deadline < time.time():
            return "deadline", "the request's deadline passed before decode"
        if req.request_id in self.states:
            return "invalid", f"duplicate request id {req.request_id}"
        if len(self.states) >= self.config.max_queue:
            return "overloaded", f"decode worker {self.worker_id} is full"
        return None

    def _prefill_locally(self, req: DecodeRequest, state: DecodeState) -> None:
        state.local_prefill = True
        try:
            if req.output_token_ids:
                # already has output (e.g. a first token from elsewhere): compute its KV too
                if (
                    self.engine.reserve(
                        req.request_id, req.prompt_token_ids, req.output_token_ids, req.sampling
                    )
                    is None
                ):
                    self._wait_for_blocks(req, state)
                    return
                self.engine.recompute(req.request_id)
            else:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling)
        except ValueError as exc:
            self.states.pop(req.request_id, None)
            self.spawn(self._fail_request(req.reply_to, req.request_id, "invalid", str(exc)))
            return
        self.wake_engine()

    def _admit_pull(self, req: DecodeRequest, state: DecodeState) -> None:
        try:
            self.kv_client.check(req.kv)  # layout mismatch: fail before reserving anything
            blocks = self.engine.reserve(
                req.request_id, req.prompt_token_ids, req.output_token_ids, req.sampling
            )
        except KVTransferError as exc:
            self.spawn(self._release_lease(req))
            self.spawn(self._pull_failed(req, state, exc, reserved=False))
            return
        except ValueError as exc:
            self.states.pop(req.request_id, None)
            self.spawn(self._fail_request(req.reply_to, req.request_id, "invalid", str(exc)))
            self.spawn(self._release_lease(req))
            return
        if blocks is None:
            self._wait_for_blocks(req, state)
            return
        state.pulling = True
        self.spawn(self._pull(req, state, blocks))

    def _wait_for_blocks(self, req: DecodeRequest, state: DecodeState) -> None:
        """No room in the cache now: queue (in order) until finished requests free blocks."""
        log.info("%s waits for KV blocks (%d queued)", req.request_id, len(self.admission) + 1)
        self.admission.append((req, state))

    def _retry_admissions(self) -> None:
        """Admit waiting requests in arrival order while their blocks fit."""
        while self.admission:
            req, state = self.admission[0]
            if self.states.get(req.request_id) is not state:  # cancelled or expired meanwhile
                self.admission.popleft()
                if req.kv is not None:
                    self.spawn(self._release_lease(req))
                continue
            if not self.engine.block_manager.can_fit(len(req.prompt_token_ids)):
                break
            self.admission.popleft()
            if req.kv is None:
                self._prefill_locally(req, state)
            else:
                self._admit_pull(req, state)

    async def _pull(self, req: DecodeRequest, state: DecodeState, blocks: list[int]) -> None:
        start_ns = time.time_ns()
        timeout = max(0.1, min(PULL_TIMEOUT, req.deadline - time.time()))
        try:
            stats = await self.kv_client.pull(req.request_id, req.kv, blocks, timeout=timeout)
        except KVTransferError as exc:
            state.pulling = False
            await self._pull_failed(req, state, exc, reserved=True)
            return
        finally:
            await self._release_lease(req)
        state.pulling = False
        end_ns = time.time_ns()
        self.metrics.kv_transfer_seconds.observe(stats.seconds)
        self.metrics.kv_transfer_bytes.inc(stats.num_bytes)
        tracing.record_span(
            tracing.SPAN_KV_TRANSFER,
            start_ns,
            end_ns,
            context=state.context,
            attributes={
                **tracing.kv_transfer_attributes(
                    state.public_id, stats.num_bytes, stats.num_blocks, stats.seconds, "ucx"
                ),
                tracing.ATTR_WORKER_ID: self.worker_id,
                "pdserve.kv.messages": stats.num_messages,
                "pdserve.prefill_worker": req.kv.worker_id,
            },
        )
        if state.cancelled or self.states.get(req.request_id) is not state:
            self.engine.abort(req.request_id)  # safe now: no transfer writes into its blocks
            return
        seq = self.engine.seqs.get(req.request_id)
        self.engine.activate(req.request_id)
        if req.request_id not in self.engine.seqs:  # nothing left to generate
            self.states.pop(req.request_id, None)
            reason = seq.finish_reason if seq is not None else "length"
            await self._publish_batch(state.reply_to, [TokenItem(req.request_id, [], reason)])
            return
        self.wake_engine()

    async def _pull_failed(
        self, req: DecodeRequest, state: DecodeState, exc: Exception, reserved: bool
    ) -> None:
        log.warning("KV pull for %s from %s failed: %s", req.request_id, req.kv.worker_id, exc)
        if state.cancelled or self.states.get(req.request_id) is not state:
            self.engine.abort(req.request_id)
            return
        if self.config.kv_failure_policy == "recompute":
            log.info("recomputing the prefill of %s locally", req.request_id)
            if reserved:
                self.engine.recompute(req.request_id)
                self.wake_engine()
            else:
                self._prefill_locally(req, state)
            return
        if reserved:
            self.engine.abort(req.request_id)
        self.states.pop(req.request_id, None)
        await self._fail_request(
            req.reply_to, req.request_id, "kv_transfer", f"KV transfer failed: {exc}"
        )

    async def _release_lease(self, req: DecodeRequest) -> None:
        try:
            await self.bus.publish(
                self.subjects.lease(req.kv.worker_id), ReleaseLease(req.request_id)
            )
        except Exception as exc:  # the lease expires on its own
            log.info("could not release the lease of %s: %s", req.request_id, exc)

    async def _fail_request(self, reply_to: str, request_id: str, code: str, text: str) -> None:
        await self._publish_batch(reply_to, [TokenItem(request_id, [], "error", text, code)])

    async def _publish_batch(self, reply_to: str, items: list[TokenItem]) -> None:
        try:
            await self.bus.publish(reply_to, TokenBatch(items))
        except Exception as exc:
            log.warning("could not publish %d token items to %s: %s", len(items), reply_to, exc)

    # -- engine outputs ------------------------------------------------------------------------

    def on_step(self, step: Step) -> None:
        stats = step.stats
        if stats.num_decodes:
            self.metrics.decode_step_time.observe(stats.seconds)
        finished = {out.request_id: out.num_cached_tokens for out in step.outputs}
        for rid in stats.prefill_seqs:  # local prefills
            state = self.states.get(rid)
            if state is not None:
                self.mark_scheduled(state, tracing.SPAN_DECODE_QUEUE, step.start_ns)
                record_prefill_forward(
                    self, state, rid, step, finished, **{tracing.ATTR_KV_TRANSPORT: "local"}
                )
        batches: dict[str, list[TokenItem]] = {}
        for out in step.outputs:
            state = self.states.get(out.request_id)
            if state is None or out.finish_reason == "abort":
                continue
            if state.first_step_ns is None:
                state.first_step_ns = step.start_ns
                # pulled KV: queued (the pull included) until this step
                self.mark_scheduled(state, tracing.SPAN_DECODE_QUEUE, step.start_ns)
            item = TokenItem(out.request_id, list(out.new_token_ids), out.finish_reason)
            if state.local_prefill and state.num_output_tokens == 0:
                item.cached_tokens = out.num_cached_tokens
            state.num_output_tokens += len(out.new_token_ids)
            batches.setdefault(state.reply_to, []).append(item)
            if out.finish_reason is not None:
                self.states.pop(out.request_id, None)
                self._record_generate(state, out.request_id, out.finish_reason, step.end_ns)
        for reply_to, items in batches.items():
            self.spawn(self._publish_batch(reply_to, items))
        if self.admission:
            self._retry_admissions()
        self.update_metrics()

    def _record_generate(self, state: DecodeState, rid: str, reason: str, end_ns: int) -> None:
        start = state.first_step_ns or end_ns
        n = state.num_output_tokens
        tpot_ms = (end_ns - start) / 1e6 / max(1, n - 1) if n > 1 else 0.0
        tracing.record_span(
            tracing.SPAN_DECODE_GENERATE,
            start,
            end_ns,
            context=state.context,
            attributes={
                tracing.ATTR_REQUEST_ID: state.public_id,
                tracing.ATTR_WORKER_ID: self.worker_id,
                tracing.GEN_AI_USAGE_OUTPUT_TOKENS: n,
                tracing.ATTR_TPOT_MS: tpot_ms,
                tracing.GEN_AI_RESPONSE_FINISH_REASONS: [reason],
            },
        )

    # -- cancel, deadlines ---------------------------------------------------------------------

    async def on_cancel(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            return
        if isinstance(state, DecodeState) and state.pulling:
            state.cancelled = True  # freed when the transfer stops writing into the blocks
            return
        self.engine.abort(request_id)
        self.wake_engine()

    async def housekeeping(self) -> None:
        if self.admission:
            self._retry_admissions()

    async def fail(self, state: RequestState, code: str, text: str) -> None:
        await self.on_cancel(state.request_id)
        await self._fail_request(state.reply_to, state.request_id, code, text)


def run(ns: argparse.Namespace) -> int:
    exit_now(DecodeWorker(ns).run())
    return 0  # not reached
