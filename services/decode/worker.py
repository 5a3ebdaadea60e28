"""The decode worker: pulls a prefilled request's KV, then generates in the continuous batch.

A request's life here is the engine's status machine, drawn beside the statuses in
``services/engine/sequence.py``: the worker posts commands (``add_request``, with
``remote_kv=True`` when the request came with a KV handle, ``kv_ready``, ``kv_failed``,
``abort``) and acts on what each step returns (tokens, and a ``KVPull`` when the engine has
reserved blocks for a request's KV: the worker pulls into them over UCX and answers once). A
request without a KV handle (short prompt, no prefill worker alive, aggregated mode) is
prefilled here. A request with ``sampling.n > 1`` forks its other choices once its prompt's KV
is here (``services/engine/sequence_group.py``): outputs name their choice (``index``), the
request ends when its last choice ends (``request_finished``), and a cancel may end one choice
only (a stop string matched in its text at the gateway).

After every engine step the worker publishes one ``TokenBatch`` per gateway inbox with every token
that step produced for that inbox, each item with its position (``decode_state.py``: also how
a ``StreamCheck`` is answered). The lease on the prefill worker's blocks is this worker's to
release, exactly once: by the pull when it is done (``kv_pulls.py``), or at once when the request
ends before the engine handed out its pull.
"""

from __future__ import annotations

import argparse
import logging
import time

from pdserve.services.decode.decode_state import DecodeState, check_answer, record_generate
from pdserve.services.decode.kv_pulls import KVPulls
from pdserve.services.decode.prefill_peers import PrefillPeers
from pdserve.services.decode.rank_pull import RankPuller
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepOutput, StepResult
from pdserve.services.probe import pull_probe
from pdserve.services.request_state import RequestState, record_prefill_forward
from pdserve.services.worker_base import Worker
from pdserve.services.worker_process import exit_now
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.stream_messages import StreamCheck, TokenBatch, TokenItem
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.contract import KVPuller
from pdserve.shared.kv.probe import ProbePullReply, ProbePullRequest, answer_probes
from pdserve.shared.kv.transfer import (
    KVClient,
)
from pdserve.shared.kv.transfer.stream import can_stream, stream_threshold
from pdserve.shared.telemetry import tracing

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role = "decode"
    service_name = tracing.SERVICE_DECODE

    def __init__(self, ns: argparse.Namespace | dict, bus: Bus | None = None) -> None:
        super().__init__(ns, bus)
        self.kv_client: KVClient | None = None
        self.puller: KVPuller | None = None  # every rank's pieces of a pull (rank_pull.py)
        self.prefill_peers = PrefillPeers(self.tasks.spawn)  # KV endpoints to the prefill workers
        self.pulls = KVPulls(self, self._end)  # into the blocks the engine reserved (kv_pulls.py)

    def make_engine(self) -> LLMEngine:
        # reprefill: the engine fails the request, and the gateway prefills it again elsewhere
        policy = "recompute" if self.config.kv_failure_policy == "recompute" else "fail"
        return LLMEngine(self.engine_config, kv_failure_policy=policy)

    async def start_extra(self) -> None:
        self.kv_client = KVClient(
            self.engine.kv_cache,
            self.engine.layout_fingerprint(),
            self.engine.block_size,
            host=self.config.ucx_host,
            port=self.config.ucx_port,
            heads=self.engine.kv_heads,
            split=self.engine.kv_split,
            checksum=self.config.kv_checksum,  # verifies every pull (KVChecksumError)
        )
        self.kv_client.own_address()  # configure UCX now: a bad --ucx-host fails at start-up
        await self.start_rank_link()
        self.puller = RankPuller(
            self.kv_client, self.rank_link, self.engine.model_config.num_kv_heads
        )
        ucx_check.warn_at_startup(self.role)  # RDMA/GPUs UCX cannot use: TCP would carry KV

    async def close_extra(self) -> None:
        if self.kv_client is not None:
            await self.kv_client.close()

    async def subscribe(self) -> None:
        await self.bus.subscribe(
            self.subjects.decode(self.worker_id), self._on_request, (DecodeRequest, StreamCheck)
        )
        await self.bus.subscribe(
            self.subjects.loads_of("prefill"), self._on_prefill_load, (WorkerLoad, WorkerGone)
        )
        await answer_probes(self.bus, self.worker_id, (ProbePullRequest,), self._on_probe)

    async def _on_probe(self, req: ProbePullRequest) -> ProbePullReply:
        return await pull_probe(
            req, self.engine, self.kv_client, self.worker_id, self.draining, self.tp_ranks
        )

    async def _on_prefill_load(
        self, load: WorkerLoad | WorkerGone, headers: dict[str, str]
    ) -> None:
        assert self.kv_client is not None  # start_extra made it before we subscribed
        self.prefill_peers.on_load(self.kv_client, load)

    def load_extra(self) -> dict:
        views = self.kv_client.layer_views if self.kv_client is not None else None
        threshold = stream_threshold(self.config.kv_stream_threshold, self.engine.device.type)
        streams = can_stream(threshold, self.config.kv_checksum, self.rank_link is None, views)
        extra = {
            "local_prefill_threshold": self.config.local_prefill_threshold,
            "kv_stream": streams,
        }
        spec = self.engine.stats().spec
        if spec is not None:
            extra.update(
                spec_drafts=spec.drafts,
                spec_draft_tokens=spec.draft_tokens,
                spec_accepted_tokens=spec.accepted_tokens,
            )
        return extra

    # -- requests ------------------------------------------------------------------------------

    async def _on_request(self, req: DecodeRequest | StreamCheck, headers: dict[str, str]) -> None:
        if not self.subjects.is_gateway_inbox(req.reply_to):
            log.warning(
                "dropping %s: reply subject %r is not a gateway inbox", req.bus_id, req.reply_to
            )
            return
        if isinstance(req, StreamCheck):
            self._answer_check(req)
            return
        if req.bus_id in self.recent_cancels:  # the gateway gave up on it already
            if req.kv is not None:
                await self.pulls.release_lease(req.bus_id, req.kv)
            return
        refusal = self._refusal(req)
        if refusal is not None:
            await self._fail_request(req.reply_to, req.bus_id, *refusal)
            if req.kv is not None and refusal[0] != "invalid":
                await self.pulls.release_lease(req.bus_id, req.kv)  # its KV is of no use now
            return
        state = DecodeState(
            bus_id=req.bus_id,
            reply_to=req.reply_to,
            deadline=req.deadline,
            context=tracing.extract_context(headers),
        )
        state.num_prompt_tokens = len(req.prompt_token_ids)
        state.client_id = req.client_id or req.bus_id
        state.kv = req.kv
        state.positions[0] = len(req.output_token_ids)  # forked choices start empty
        try:
            self.engine.add_request(
                req.bus_id,
                req.prompt_token_ids,
                req.sampling,
                req.output_token_ids,
                remote_kv=req.kv is not None,
                lora=req.lora,
            )
        except ValueError as exc:  # invalid for this model (too long, token id out of range...)
            await self._fail_request(req.reply_to, req.bus_id, "invalid", str(exc))
            if req.kv is not None:
                await self.pulls.release_lease(req.bus_id, req.kv)
            return
        self.states[req.bus_id] = state

    def _refusal(self, req: DecodeRequest) -> tuple[str, str] | None:
        if self.draining:
            return "draining", f"decode worker {self.worker_id} is draining"
        if req.deadline < time.time():
            return "deadline", "the request's deadline passed before decode"
        if req.bus_id in self.states:
            return "invalid", f"duplicate request id {req.bus_id}"
        if len(self.states) >= self.config.max_queue:
            return "overloaded", f"decode worker {self.worker_id} is full"
        if req.kv is not None and req.kv.lora != req.lora:
            # KV computed under one adapter never serves another (nor the base model)
            return "invalid", f"KV computed under adapter {req.kv.lora!r}, not {req.lora!r}"
        return None

    def _end(self, state: DecodeState) -> None:
        """The request leaves this worker (finished, failed, cancelled)."""
        if self.states.pop(state.bus_id, None) is not state:
            return  # it left already
        if state.kv is not None and state.pull is None:  # never pulled: free it there now
            self.tasks.spawn(self.pulls.release_lease(state.bus_id, state.kv))

    async def _fail_request(self, reply_to: str, bus_id: str, code: str, text: str) -> None:
        await self._publish_batch(
            reply_to,
            [
                TokenItem(
                    bus_id=bus_id, token_ids=[], finish_reason="error", error=text, error_code=code
                )
            ],
        )

    async def _publish_batch(
        self, reply_to: str, items: list[TokenItem], replayable: bool = False
    ) -> None:
        # Token batches are replayable (state.py); refusals and check answers are not: a
        # refused leg is re-sent elsewhere under the same id, and an answer holds for its check.
        try:
            await self.bus.publish(reply_to, TokenBatch(items=items), replayable=replayable)
        except Exception as exc:
            log.warning("could not publish %d token items to %s: %s", len(items), reply_to, exc)

    def _answer_check(self, check: StreamCheck) -> None:
        # Spawned like the token batches, after them: tasks start in order and each publish is
        # in the connection's buffer before it yields, so the answer follows what it counts.
        items = check_answer(check, self.states.get(check.bus_id), self.worker_id)
        self.tasks.spawn(self._replay_and_answer(check.reply_to, items))

    async def _replay_and_answer(self, reply_to: str, items: list[TokenItem]) -> None:
        await self.bus.replay(reply_to)  # what that gateway may have missed, then the answer
        await self._publish_batch(reply_to, items)

    # -- engine outputs ------------------------------------------------------------------------

    def on_step(self, step: StepResult) -> None:
        stats = step.stats
        if stats.num_decodes:
            self.metrics.decode_step_time.observe(stats.seconds)
        for rid in stats.prefill_seqs:  # local prefills
            state = self.states.get(rid)
            if state is not None:
                self.mark_scheduled(state, tracing.SPAN_DECODE_QUEUE, step.start_ns)
                record_prefill_forward(
                    state, self.worker_id, step, **{tracing.ATTR_KV_TRANSPORT: "local"}
                )
        for pull in step.pulls:
            self.pulls.start(pull)
        batches: dict[str, list[TokenItem]] = {}
        for out in step.outputs:
            state = self.states.get(out.bus_id)
            if state is not None:
                item = self._item(state, out, step)
                batches.setdefault(state.reply_to, []).append(item)
        for reply_to, items in batches.items():
            self.tasks.spawn(self._publish_batch(reply_to, items, replayable=True))
        self.report.update_metrics()

    def _item(self, state: DecodeState, out: StepOutput, step: StepResult) -> TokenItem:
        rid = out.bus_id
        if out.finish_reason == "error":  # the pull failed under the fail or reprefill policy
            self._end(state)
            reprefill = self.config.kv_failure_policy == "reprefill"
            return TokenItem(
                bus_id=rid,
                token_ids=[],
                finish_reason="error",
                error=out.error,
                error_code="kv_reprefill" if reprefill else "kv_transfer",
            )
        state.started = True  # from now on the gateway judges stalls, not the deadline
        first = state.first_step_ns is None  # its first output: the step that ended its prefill
        if first:
            state.first_step_ns = step.start_ns
            state.roofline_mark = self.metrics.roofline.decode_mark()  # the totals before it
            # pulled KV: queued (the pull included) until this step
            self.mark_scheduled(state, tracing.SPAN_DECODE_QUEUE, step.start_ns)
        position = state.advance(out.index, len(out.new_token_ids))
        item = TokenItem(
            bus_id=rid,
            token_ids=list(out.new_token_ids),
            finish_reason=out.finish_reason,
            index=out.index,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            position=position,
        )
        if first and state.local_prefill:
            # a fact of that prefill; the gateway reports a request's once (a migration prefills
            # again, and only the gateway knows it)
            item.cached_tokens = out.num_prefix_hit_tokens
        state.num_output_tokens += len(out.new_token_ids)
        state.num_draft_tokens += out.num_draft_tokens
        state.num_accepted_tokens += out.num_accepted_tokens
        if out.request_finished:  # every choice is over
            self._end(state)
            record_generate(
                state,
                self.worker_id,
                out.finish_reason or "stop",
                step.end_ns,
                self.metrics.roofline.since(state.roofline_mark),
            )
        return item

    # -- cancel, deadlines ---------------------------------------------------------------------

    async def on_cancel(self, bus_id: str) -> None:
        state = self.states.get(bus_id)
        if state is None:
            return
        self._end(state)
        self.engine.abort(bus_id)  # mid-pull: freed once the pull stops writing
        if isinstance(state, DecodeState) and state.pull is not None and not state.pull.done():
            # a pull of KV nobody wants: stopped now (the server completes its receives, or its
            # endpoint is aborted; the lease released, kv_failed) rather than at --kv-pull-timeout
            state.pull.cancel()

    async def on_cancel_choice(self, bus_id: str, index: int) -> None:
        if bus_id in self.states:
            self.engine.abort(bus_id, index)

    async def fail(self, state: RequestState, code: str, text: str) -> None:
        await self.on_cancel(state.bus_id)
        await self._fail_request(state.reply_to, state.bus_id, code, text)


def run(ns: argparse.Namespace) -> int:
    exit_now(DecodeWorker(ns).run())
    return 0  # not reached
