"""The prefill worker: prompts in, first token out at once, KV held under a lease for the pull.

Requests queue in the engine, which packs as many prompts per forward as the token budget allows
(long ones are chunked). When a prompt's last chunk is done the engine samples the first token and
parks the sequence with its blocks (``prefill_only``). The worker then leases those blocks and
publishes a ``PrefillResult`` with the first token and a ``KVHandle`` to the gateway immediately -
that message is the request's time to first token.

The lease ends when the decode worker says it has pulled (``ReleaseLease``), when the request is
cancelled, or when it expires (``lease_seconds``); the blocks go back to the engine then.

Layer-wise streaming (``--kv-stream-threshold``, issue 29 item 3): a long prompt whose request
allows it (``PrefillRequest.stream_kv``) is leased when the forward pass that completes it
starts (``services/engine/kv_stream.py``), and a ``PrefillResult`` with that handle and no token
goes out at once, so a decode worker pulls each layer group as the pass writes it; the pass's
end completes the lease's stream with the first token (``shared/kv/transfer/stream.py``), and
the usual ``PrefillResult`` follows.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.kv_stream import StreamHooks, StreamStart
from pdserve.services.engine.outputs import StepResult
from pdserve.services.probe import lease_probe
from pdserve.services.request_state import RequestState, record_prefill_forward
from pdserve.services.worker_base import Worker
from pdserve.services.worker_process import exit_now
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.request_messages import PrefillRequest, PrefillResult
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.contract import KVLayerFeed
from pdserve.shared.kv.probe import ProbeLeaseReply, ProbeLeaseRequest, answer_probes
from pdserve.shared.kv.transfer import KVServer, Lease, LeaseTable
from pdserve.shared.kv.transfer.stream import (
    FINISHED,
    LayerStream,
    can_stream,
    stream_threshold,
)
from pdserve.shared.telemetry import tracing

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    role = "prefill"
    service_name = tracing.SERVICE_PREFILL

    def __init__(self, ns: argparse.Namespace | dict, bus: Bus | None = None) -> None:
        super().__init__(ns, bus)
        self.leases = LeaseTable(self._free_lease)
        self.kv_server: KVServer | None = None
        self.rank_addresses: list[str] = []  # TP > 1: every rank's KV server, by rank
        self.stream_ok: set[str] = set()  # requests whose KV may stream (stream_kv, long)
        self.streams: dict[str, KVLayerFeed] = {}  # streamed leases until their pass ends
        self.stream_from = 0  # prompt tokens from which KV streams (0: never; start_extra)

    def make_engine(self) -> LLMEngine:
        return LLMEngine(self.engine_config, prefill_only=True)

    async def start_extra(self) -> None:
        assert self.engine is not None
        # leases record, and pulls are checked against, the engine's block generations
        self.leases.generations = self.engine.block_manager.generations
        self.kv_server = KVServer(
            self.engine.kv_cache,
            self.engine.layout_fingerprint(),
            self.leases,
            host=self.config.ucx_host,
            port=self.config.ucx_port,
            heads=self.engine.kv_heads,
            split=self.engine.kv_split,
            checksum=self.config.kv_checksum,  # hashes each lease's blocks as it is added
        )
        await self.kv_server.start()
        others = await self.start_rank_link()
        if others:  # TP > 1: each rank serves its own heads
            self.rank_addresses = [self.kv_server.address] + [r["address"] for r in others]
        ucx_check.warn_at_startup(self.role)  # RDMA/GPUs UCX cannot use: TCP would carry KV
        threshold = stream_threshold(self.config.kv_stream_threshold, self.engine.device.type)
        if can_stream(
            threshold, self.config.kv_checksum, self.rank_link is None, self.kv_server.layer_views
        ):
            self.stream_from = threshold
            log.info("KV of prompts from %d tokens streams layer by layer", threshold)
            loop = asyncio.get_running_loop()
            self.engine.stream_hooks = StreamHooks(
                self.stream_from,
                lambda starts: loop.call_soon_threadsafe(self._stream_start, starts),
                lambda ids, n, ev: loop.call_soon_threadsafe(self._stream_layers, ids, n, ev),
            )

    async def close_extra(self) -> None:
        if self.kv_server is not None:
            await self.kv_server.stop()

    async def subscribe(self) -> None:
        # Requests are addressed to this worker by name (the gateway routes), so no queue group.
        await self.bus.subscribe(
            self.subjects.prefill(self.worker_id), self._on_request, (PrefillRequest,)
        )
        await self.bus.subscribe(
            self.subjects.lease(self.worker_id), self._on_release, (ReleaseLease,)
        )
        await answer_probes(self.bus, self.worker_id, (ProbeLeaseRequest,), self._on_probe)

    async def _on_probe(self, req: ProbeLeaseRequest) -> ProbeLeaseReply:
        return await lease_probe(
            req,
            self.engine,
            self.leases,
            self.make_handle,
            self.worker_id,
            self.draining,
            self.tp_ranks,
        )

    def load_extra(self) -> dict:
        return {"ucx_address": self.kv_server.address if self.kv_server else ""}

    def busy(self) -> bool:
        return bool(self.states) or len(self.leases) > 0

    def work_counts(self) -> dict[str, int]:
        # a draining prefill worker also waits for the pulls of the KV it leased
        return {**super().work_counts(), "leases": len(self.leases)}

    # -- requests ------------------------------------------------------------------------------

    async def _on_request(self, req: PrefillRequest, headers: dict[str, str]) -> None:
        if not self.subjects.is_gateway_inbox(req.reply_to):
            log.warning(
                "dropping %s: reply subject %r is not a gateway inbox", req.bus_id, req.reply_to
            )
            return
        if req.bus_id in self.recent_cancels:
            return  # the gateway gave up on it already
        refusal = self._refusal(req)
        if refusal is not None:
            code, text = refusal
            await self._reply(
                req.reply_to, PrefillResult.failure(req.bus_id, self.worker_id, code, text)
            )
            return
        state = RequestState(
            bus_id=req.bus_id,
            reply_to=req.reply_to,
            deadline=req.deadline,
            context=tracing.extract_context(headers),
        )
        state.num_prompt_tokens = len(req.prompt_token_ids)
        state.client_id = req.client_id or req.bus_id
        state.lora = req.lora
        try:
            self.engine.add_request(req.bus_id, req.prompt_token_ids, req.sampling, lora=req.lora)
        except ValueError as exc:  # invalid for this model (too long, token id out of range...)
            await self._reply(
                req.reply_to,
                PrefillResult.failure(req.bus_id, self.worker_id, "invalid", str(exc)),
            )
            return
        self.states[req.bus_id] = state
        if req.stream_kv and 0 < self.stream_from <= state.num_prompt_tokens:
            self.stream_ok.add(req.bus_id)

    def _refusal(self, req: PrefillRequest) -> tuple[str, str] | None:
        if self.draining:
            return "draining", f"prefill worker {self.worker_id} is draining"
        if req.deadline < time.time():
            return "deadline", "the request's deadline passed before prefill"
        if req.bus_id in self.states or self.leases.get(req.bus_id) is not None:
            return "invalid", f"duplicate request id {req.bus_id}"
        if len(self.states) >= self.config.max_queue:
            return "overloaded", f"prefill worker {self.worker_id} queue is full"
        return None

    async def _reply(
        self, subject: str, result: PrefillResult, headers: dict[str, str] | None = None
    ) -> None:
        try:
            await self.bus.publish(subject, result, headers)
        except Exception as exc:
            log.warning("could not reply for %s: %s", result.bus_id, exc)

    # -- engine outputs ------------------------------------------------------------------------

    def on_step(self, step: StepResult) -> None:
        self._record_forward(step)
        for out in step.outputs:
            state = self.states.pop(out.bus_id, None)
            self.stream_ok.discard(out.bus_id)
            if state is None:  # cancelled meanwhile: make sure nothing stays parked
                self.engine.release(out.bus_id)
                continue
            self.metrics.prefill_time.observe(
                (step.end_ns - (state.first_scheduled_ns or step.start_ns)) / 1e9
            )
            token = out.new_token_ids[0] if out.new_token_ids else None
            kv = None
            if out.bus_id in self.streams:  # leased when its pass started
                kv = self._stream_end(out.bus_id, out.kv_block_ids is not None, token)
            elif out.kv_block_ids is not None:  # parked: its blocks go under a lease
                lease = self.leases.add(
                    out.bus_id, out.kv_block_ids, out.num_kv_tokens, self.config.lease_seconds
                )
                lease.lora = state.lora
                kv = self.make_handle(lease)
            result = PrefillResult(
                bus_id=out.bus_id,
                worker_id=self.worker_id,
                first_token=token,
                finish_reason=out.finish_reason,
                kv=kv,
                error=None,
                cached_tokens=out.num_prefix_hit_tokens,
                first_logprobs=out.logprobs,
                prompt_logprobs=out.prompt_logprobs,
            )
            headers = tracing.inject_headers(context=state.context)
            self.tasks.spawn(self._mirror_then_reply(state.reply_to, result, headers))
        self.report.update_metrics()

    # -- layer-wise streaming (on the loop; the engine thread calls through StreamHooks) -----

    def _stream_start(self, starts: list[StreamStart]) -> None:
        """A pass that completes these prompts starts: lease the blocks, hand out the handle."""
        for start in starts:
            state = self.states.get(start.bus_id)
            if state is None or start.bus_id not in self.stream_ok:
                continue
            if self.leases.get(start.bus_id) is not None:
                continue
            done = start.block_ids[: start.num_ready_tokens // self.engine.block_size]
            stream = LayerStream(self.engine.model_config.num_layers, done_blocks=frozenset(done))
            lease = self.leases.add(
                start.bus_id,
                start.block_ids,
                start.num_tokens,
                self.config.lease_seconds,
                stream=stream,
            )
            lease.lora = state.lora
            self.streams[start.bus_id] = stream
            early = PrefillResult(
                bus_id=start.bus_id,
                worker_id=self.worker_id,
                first_token=None,
                finish_reason=None,
                kv=self.make_handle(lease),
                error=None,
            )
            headers = tracing.inject_headers(context=state.context)
            self.tasks.spawn(self._reply(state.reply_to, early, headers))

    def _stream_layers(self, bus_ids: list[str], layers: int, event: object) -> None:
        for bus_id in bus_ids:
            stream = self.streams.get(bus_id)
            if stream is not None:
                stream.advance(layers, event)

    def _stream_end(self, bus_id: str, parked: bool, token: int | None) -> KVHandle | None:
        """The pass of a streamed prompt is over: its stream completes with the first token
        (the handle for the PrefillResult), or ends - the request finished at its first token,
        failed, or its lease was let go meanwhile - and its blocks go back."""
        stream = self.streams.pop(bus_id)
        lease = self.leases.get(bus_id)
        if parked and lease is not None and token is not None:
            self.leases.restart(lease, self.config.lease_seconds)  # unpulled from now on
            # after the PrefillResult's publish (its task is spawned next and runs in the next
            # loop turn): the gateway hears of the first token before the tokens that follow it
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, stream.finish, token)
            return self.make_handle(lease)
        stream.end(FINISHED if token is not None else "no first token")
        if lease is not None:
            self._release(bus_id)  # the blocks go back once no piece reads them
        elif parked:
            self.engine.release(bus_id)
        return None

    def _stream_drop(self, bus_id: str, why: str) -> None:
        """A streamed request ends here before its pass did (cancelled, failed)."""
        self.stream_ok.discard(bus_id)
        stream = self.streams.pop(bus_id, None)
        if stream is not None:
            stream.end(why)

    def make_handle(self, lease: Lease) -> KVHandle:
        """What a decode worker needs to pull ``lease``'s blocks (requests and doctor probes)."""
        return KVHandle(
            worker_id=self.worker_id,
            ucx_address=self.kv_server.address,
            block_ids=list(lease.block_ids),
            num_tokens=lease.num_tokens,
            fingerprint=self.engine.layout_fingerprint(),
            lease_expires=lease.expires,
            token=lease.token,
            rank_addresses=list(self.rank_addresses),
            streaming=lease.stream is not None,
            ready_blocks=len(lease.stream.done_blocks) if lease.stream is not None else 0,
            epoch=lease.epoch or 0,
            lora=lease.lora,
        )

    async def _mirror_then_reply(self, reply_to: str, result: PrefillResult, headers: dict) -> None:
        """TP > 1: every rank knows the lease before any decode worker can ask for it."""
        lease = self.leases.get(result.bus_id) if result.kv is not None else None
        if lease is not None and self.rank_link is not None:
            try:
                await self.rank_link.call_all(
                    "lease",
                    bus_id=lease.bus_id,
                    block_ids=lease.block_ids,
                    num_tokens=lease.num_tokens,
                    expires=lease.expires,
                    token=lease.token,
                )
            except Exception as exc:  # a rank is gone: the pull fails and the worker leaves
                log.error("could not hand the lease of %s to every rank: %s", lease.bus_id, exc)
        await self._reply(reply_to, result, headers)

    def _release(self, bus_id: str) -> None:
        if self.leases.release(bus_id) and self.rank_link is not None:
            self.tasks.spawn(self.rank_link.call_all("release", bus_id=bus_id))

    def _record_forward(self, step: StepResult) -> None:
        """prefill.queue once per request, prefill.forward per forward pass it took part in."""
        for rid in step.stats.prefill_seqs:
            state = self.states.get(rid)
            if state is None:
                continue
            self.mark_scheduled(state, tracing.SPAN_PREFILL_QUEUE, step.start_ns)
            record_prefill_forward(state, self.worker_id, step)

    # -- leases, cancel, deadlines ---------------------------------------------------------------

    def _free_lease(self, bus_id: str) -> None:
        self.engine.release(bus_id)  # waiting prompts may fit now

    async def _on_release(self, msg: ReleaseLease, headers: dict[str, str]) -> None:
        self._release(msg.bus_id)
        self.report.update_metrics()

    async def on_cancel(self, bus_id: str) -> None:
        self._stream_drop(bus_id, "cancelled")
        if self.states.pop(bus_id, None) is not None:
            self.engine.abort(bus_id)
        self._release(bus_id)  # (a streamed lease is taken before the prompt is done)

    async def fail(self, state: RequestState, code: str, text: str) -> None:
        self._stream_drop(state.bus_id, code)
        self._release(state.bus_id)
        self.states.pop(state.bus_id, None)
        self.engine.abort(state.bus_id)
        result = PrefillResult.failure(state.bus_id, self.worker_id, code, text)
        await self._reply(state.reply_to, result)

    async def housekeeping(self) -> None:
        self.leases.expire()


def run(ns: argparse.Namespace) -> int:
    exit_now(PrefillWorker(ns).run())
    return 0  # not reached
