"""Applying the commands that drive each request's lifecycle, on the engine thread.

``LLMEngine.step`` applies every posted command (``commands.py``) before it schedules: adding a
request, aborting it or one of its choices, releasing a parked one, and a pull's answer. The
statuses and their transitions are written out in ``services/decode/worker.py``; the choices of
a request with ``sampling.n > 1`` (one prefill, then a fork) in ``choices.py``.
"""

from __future__ import annotations

import logging
import random
import time

import torch

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.choices import ChoiceGroup, num_choices
from pdserve.services.engine.commands import (
    Abort,
    AddRequest,
    BlockHoldRefused,
    Command,
    HoldBlock,
    KVReady,
    Release,
)
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.outputs import StepOutput
from pdserve.services.engine.scheduler import Scheduler
from pdserve.services.engine.sequence import Sequence, SequenceStatus
from pdserve.services.engine.spec.speculator import Speculator
from pdserve.shared.sampling import SamplingParams

log = logging.getLogger(__name__)

_HOLD_SAMPLING = SamplingParams(max_tokens=1)


class RequestLifecycle:
    """The command side of ``LLMEngine`` (a mixin: the engine owns the state below)."""

    prefill_only: bool
    kv_failure_policy: str
    kv_cache: torch.Tensor
    block_manager: BlockManager
    scheduler: Scheduler
    seqs: dict[str, Sequence]  # by seq_id
    requests: dict[str, ChoiceGroup]  # by request id
    _seed_rng: random.Random
    model_config: ModelConfig
    max_model_len: int
    speculator: Speculator | None

    def _apply(self, cmd: Command, outputs: list[StepOutput]) -> None:
        if isinstance(cmd, AddRequest):
            self._add(cmd, outputs)
        elif isinstance(cmd, HoldBlock):
            self._hold(cmd)
        elif (group := self.requests.get(cmd.bus_id)) is None:
            return  # finished or aborted meanwhile
        elif isinstance(cmd, Abort):
            self._abort(group, cmd.index)
        elif (seq := group.seqs.get(0)) is None:
            return  # the rest concern choice 0's prompt (parked or pulled), before any fork
        elif isinstance(cmd, Release):
            if seq.status is SequenceStatus.PREFILLED:
                self._finish(seq, None)
        elif seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KV:
            log.warning("%s for %s, which is %s", type(cmd).__name__, seq, seq.status.name)
        elif seq.finish_reason is not None:  # aborted during its pull: blocks are safe now
            self._finish(seq, seq.finish_reason)
        elif isinstance(cmd, KVReady):
            self._kv_ready(seq)
        else:
            self._kv_failed(seq, cmd.error, outputs)

    def _add(self, cmd: AddRequest, outputs: list[StepOutput]) -> None:
        rid = cmd.bus_id
        if rid in self.requests:
            log.error("dropping a second request with id %r", rid)
            return
        sp = cmd.sampling
        seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(rid, cmd.prompt_token_ids, sp, seed, time.monotonic())
        seq.token_ids.extend(cmd.output_token_ids)
        seq.remote_kv = cmd.remote_kv
        self._register(seq, num_choices(sp))
        self.scheduler.add(seq)
        reason = self._finished_reason(seq)
        if reason is None:
            return
        # e.g. max_tokens reached by the first token: nothing to do, unless choices are still
        # to fork from its prompt (it carries their KV until then)
        out = StepOutput(rid, [], reason)
        if (group := self.requests[rid]).unforked:
            group.end_choice(0)
        else:
            out.request_finished = self._finish(seq, reason)
        outputs.append(out)

    def _register(self, seq: Sequence, n: int) -> None:
        self.seqs[seq.seq_id] = seq
        self.requests[seq.bus_id] = ChoiceGroup.start(seq, n)

    def _abort(self, group: ChoiceGroup, index: int | None) -> None:
        for seq in group.end_choice(index):
            if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
                seq.finish_reason = "abort"  # a pull writes into its blocks until it answers
            else:
                self._finish(seq, "abort")

    def _kv_ready(self, seq: Sequence) -> None:
        seq.remote_kv = False
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)
        self.scheduler.start_running(seq)
        self._fork(seq)  # the prefill worker sampled choice 0's first token: the others now

    def _kv_failed(self, seq: Sequence, error: str, outputs: list[StepOutput]) -> None:
        if self.kv_failure_policy == "fail":  # the whole request: no choice was forked yet
            self._finish(seq, "error")
            text = f"KV transfer failed: {error}"
            outputs.append(StepOutput(seq.bus_id, [], "error", error=text, request_finished=True))
            return
        log.info("recomputing the prefill of %s here: %s", seq.bus_id, error)
        self.scheduler.remove(seq)  # frees its blocks: the pull is over
        seq.remote_kv = False
        seq.num_computed_tokens = 0
        self.scheduler.requeue_first(seq)  # its choices fork after this prefill

    def _fork(self, seq: Sequence) -> bool:
        """Fork the request's other choices from ``seq`` (choice 0, whose prompt's KV is
        complete and first token sampled) if they are still to fork (``choices.py``). True when
        ``seq`` only carried the prompt for them (its own choice is over) and has left: it has
        nothing to say."""
        group = self.requests[seq.bus_id]
        if not group.unforked or self.prefill_only:  # a prefill worker's: forked after the pull
            return False
        children, copies = group.fork(seq, self.block_manager, self.scheduler)
        self.seqs.update((child.seq_id, child) for child in children)
        if copies:  # copy-on-write, done at once: each child's block of the last prompt token
            src, dst = zip(*copies, strict=True)
            self.kv_cache[list(dst)] = self.kv_cache[list(src)]
        if group.needs(seq):
            return False
        self._finish(seq, seq.finish_reason)
        return True

    def _hold(self, cmd: HoldBlock) -> None:
        if not cmd.reply.set_running_or_notify_cancel():
            return  # the asker gave up
        waiting = len(self.scheduler.waiting)
        if cmd.hold_id in self.requests:
            refusal = f"{cmd.hold_id} exists"
        elif waiting:
            refusal = f"busy: {waiting} request(s) waiting; no block is taken from them"
        elif not self.scheduler.fits(1):
            refusal = "busy: no free KV block"
        else:
            seq = Sequence(cmd.hold_id, [0], _HOLD_SAMPLING, 0, time.monotonic())
            self.block_manager.allocate(seq, 1)
            seq.status = SequenceStatus.PREFILLED
            self._register(seq, 1)
            cmd.reply.set_result(seq.block_table[0])
            return
        cmd.reply.set_exception(BlockHoldRefused(refusal))

    def _finished_reason(self, seq: Sequence) -> str | None:
        return seq.ended_by(self.model_config.eos_token_ids, self.max_model_len)

    def _finish(self, seq: Sequence, reason: str | None) -> bool:
        """``seq`` leaves the engine. True when it was its request's last open choice."""
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        group = self.requests[seq.bus_id]
        request_finished = group.remove(seq)
        if not group.seqs:  # (choices never forked here, e.g. on a prefill worker, end too)
            del self.requests[seq.bus_id]
        return request_finished
