"""The scheduler: every status change of every sequence (``sequence.py`` draws the machine), and
the batch of each step.

After the engine's commands (``add_request``, ``abort``, ``release``, ``kv_ready``,
``kv_failed``, ``hold_block``), ``schedule`` picks the batch, the runner computes it, and
``update_from_output`` applies its output: tokens appended up to a stop, drafts accepted or
rolled back, choices forked, sequences finished or parked. Nothing here touches a tensor: the KV
copies a fork needs wait in ``block_copies`` for the engine.

A batch serves running sequences oldest-first (a decode's token, a prompt's next chunk, a
draft's 1 + k tokens), then admits waiting ones in arrival order while slots, token budget and
blocks last (under ``--scheduling-policy priority`` both in rank order, a prompt's chunks
yielding to a better-ranked head: ``wait_queue.py``, which also orders the decode side's pulls
and picks preemption victims). One admission policy for
local prompts and pulls (``remote_kv``: blocks reserved, no budget): the blocks needed, plus a little headroom once others run, must be free - checked
before anything is attached, so a head that does not fit leaves the prefix cache and its
counters as they were. A running sequence short of a block preempts the newest one (under
priority, the worst-ranked of those not yet in the batch); a draft is
cut to the budget and to blocks no later running sequence may need, so it never preempts. A
prefix found on the disk tier (``kv_tiers/``) is pull-like: blocks reserved, the sequence waits
until the engine's ``kv_loaded`` (the load runs on the disk tier's thread).
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from pdserve.services.engine.block_holds import BlockHolds
from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.commands import (
    AddRequest,
)
from pdserve.services.engine.kv_arrivals import KVArrivals
from pdserve.services.engine.outputs import RunnerOutput, ScheduledBatch, StepOutput, StepStats
from pdserve.services.engine.sequence import Sequence, SequenceStatus
from pdserve.services.engine.sequence_group import SequenceGroup, num_choices
from pdserve.services.engine.wait_queue import WaitQueue

if TYPE_CHECKING:  # the spec package loads models: the scheduler only calls back into it
    from pdserve.services.engine.lora.slots import AdapterCache
    from pdserve.services.engine.spec.speculator import Speculator

log = logging.getLogger(__name__)

KV_FAILURE_POLICIES = ("fail", "recompute")


class Scheduler(KVArrivals, BlockHolds):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        *,
        prefill_only: bool = False,
        kv_failure_policy: str = "fail",
        speculator: Speculator | None = None,
        seed: int = 0,
        scheduling_policy: str = "fcfs",
        priority_aging_s: float = 0.0,
        prompt_deadline_s: float = 0.0,
        lora: AdapterCache | None = None,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.prefill_only = prefill_only
        self.kv_failure_policy = kv_failure_policy
        self.speculator = speculator
        self.lora = lora  # the resident LoRA adapters' slots (None: no --lora-modules)
        self.seqs: dict[str, Sequence] = {}  # every sequence held, by seq_id
        self.requests: dict[str, SequenceGroup] = {}  # by bus id: its choices' sequences
        # WAITING and PREEMPTED, in admission order (--scheduling-policy: wait_queue.py)
        self.waiting = WaitQueue(scheduling_policy, priority_aging_s, prompt_deadline_s)
        self.running: list[Sequence] = []
        self.pulling: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV, by seq_id
        # (source, new) block copies of forks, for the engine to make before its next forward
        self.block_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        # Admission keeps a little headroom so running decodes can grow without instant preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self._seed_rng = random.Random(seed)  # seeds of requests that name none
        self._blocked: Sequence | None = None  # head of the queue last logged as not fitting

    # ---- commands: requests in, answers of pulls ---------------------------------------------

    def add_request(self, req: AddRequest) -> StepOutput | None:
        """Queue a request as its choice 0. Returns its output when the tokens it came with
        already end it (e.g. max_tokens reached by a prefill worker's first token)."""
        if req.bus_id in self.requests:
            log.error("dropping a second request with id %r", req.bus_id)
            return None
        if req.lora is not None and (self.lora is None or req.lora not in self.lora.modules):
            # unloaded between its check on the caller's thread and now
            error = f"LoRA adapter {req.lora!r} is not loaded"
            return StepOutput(
                bus_id=req.bus_id,
                new_token_ids=[],
                finish_reason="error",
                error=error,
                request_finished=True,
            )
        sp = req.sampling
        seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(req.bus_id, req.prompt_token_ids, sp, seed, time.monotonic())
        seq.token_ids.extend(req.output_token_ids)
        seq.remote_kv = req.remote_kv
        seq.lora_name = req.lora
        if self.lora is not None and req.lora is not None:
            self.lora.request_added(req.lora)  # an unload waits for it
        self._register(seq, num_choices(sp))
        self.waiting.append(seq)
        reason = self._ended(seq)
        if reason is None:
            return None
        # nothing to do, unless choices are still to fork from its prompt (it carries their KV)
        out = StepOutput(bus_id=req.bus_id, new_token_ids=[], finish_reason=reason)
        if (group := self.requests[req.bus_id]).unforked:
            group.end_choice(0)
        else:
            out.request_finished = self._finish(seq, reason)
        return out

    def abort(self, bus_id: str, index: int | None = None) -> None:
        """End choice ``index`` (None: all) without an output; unknown ids are ignored."""
        group = self.requests.get(bus_id)
        for seq in group.end_choice(index) if group is not None else ():
            if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
                seq.finish_reason = "abort"  # a pull writes into its blocks until it answers
            else:
                self._finish(seq, "abort")

    def release(self, bus_id: str) -> None:
        """A parked sequence (or a held block) gives its blocks back."""
        seq = self._choice_0(bus_id)
        if seq is not None and seq.status is SequenceStatus.PREFILLED:
            self._finish(seq, None)

    def _register(self, seq: Sequence, n: int) -> None:
        self.seqs[seq.seq_id] = seq
        self.requests[seq.bus_id] = SequenceGroup.start(seq, n)

    def _choice_0(self, bus_id: str) -> Sequence | None:
        """Choice 0 of a request still here: the one that carries its prompt before any fork."""
        return group.seqs.get(0) if (group := self.requests.get(bus_id)) is not None else None

    # ---- the batch ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pulling)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        rows: list[tuple[Sequence, int]] = []
        pulls: list[Sequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.waiting.defers(seq) and self._head_admissible():
                i += 1  # its next prompt chunk yields to a better-ranked head (wait_queue.py)
                continue
            if seq.spec_token_ids:  # cut to the budget and to blocks no later one may need
                later = len(self.running) - i - 1
                seq.cut_draft(
                    min(
                        len(seq.spec_token_ids),
                        budget - seq.num_uncomputed_tokens,
                        self.bm.room(seq, seq.num_tokens, later),
                    )
                )
            n = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.waiting.victim(self.running, i)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            rows.append((seq, n))
            budget -= n
            i += 1

        self.waiting.demote_late(time.monotonic())  # (the clock of Sequence.arrival)
        while not preempted and self.waiting and self._num_slots() > 0:
            seq = self.waiting[0]
            if self.lora is not None and not self.lora.pin(seq):  # every slot busy: it waits
                self._log_blocked(seq)
                break
            if seq.remote_kv:
                if not self._admit_pull(seq):
                    break
                pulls.append(seq)
                continue
            if budget <= 0:
                break
            n = self._admit(seq, budget)
            if not n:
                break
            if seq.status is SequenceStatus.RUNNING:  # (else its prefix loads from disk first)
                rows.append((seq, n))
                budget -= n
        return ScheduledBatch.build(rows, pulls) if rows or pulls else None

    def _num_slots(self) -> int:
        """How many more sequences may run (or pull) within ``max_num_seqs``."""
        return self.max_num_seqs - len(self.running) - len(self.pulling)

    def _head_admissible(self) -> bool:
        """The head of the queue may be admitted this step: a slot is free and its blocks did
        not fail to fit last time (else a deferred prompt would wait for nothing)."""
        return self._num_slots() > 0 and self._blocked is not self.waiting[0]

    def _headroom(self) -> int:
        """Free blocks admission leaves once others run, so their decodes can grow without
        instant preemption."""
        return self.watermark_blocks if self.running or self.pulling else 0

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admit the head of the queue to compute its next ``n`` tokens (returned; 0 when its
        blocks do not fit, and then nothing is attached to it). Its cached prefix is looked up
        first and attached only once the rest fits (prompt log-probs score every token, so a
        sequence that asks for them takes no prefix)."""
        prefix = None if seq.needs_prompt_logprobs else self.bm.find_prefix(seq)
        computed = prefix.num_tokens if prefix is not None else seq.num_computed_tokens
        n = min(seq.num_tokens - computed, budget)
        if not self.bm.can_allocate(seq, computed + n, prefix, self._headroom()):
            self._log_blocked(seq)
            return 0
        if prefix is not None:
            seq.num_computed_tokens = self.bm.attach_prefix(seq, prefix)
            seq.num_prefix_hit_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.waiting.popleft()
        self.bm.allocate(seq, seq.num_computed_tokens + n)
        if self.bm.waits_for_load(seq):
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
            self.pulling[seq.seq_id] = seq
            return n
        self._run(seq)
        return n

    def _admit_pull(self, seq: Sequence) -> bool:
        """Reserve blocks for the prompt a prefill worker computed; False when they do not fit."""
        if not self.bm.can_allocate(seq, seq.num_prompt_tokens, headroom=self._headroom()):
            self._log_blocked(seq)
            return False
        self.waiting.popleft()
        self.bm.allocate(seq, seq.num_prompt_tokens)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.pulling[seq.seq_id] = seq
        return True

    def _log_blocked(self, seq: Sequence) -> None:
        if self._blocked is not seq:
            self._blocked = seq
            log.info("%s waits for KV blocks (%d queued)", seq.seq_id, len(self.waiting))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.cut_draft(0)
        self._wait_first(seq, SequenceStatus.PREEMPTED)
        self.num_preemptions += 1

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.waiting.place(self.running, seq)

    def _wait_first(self, seq: Sequence, status: SequenceStatus = SequenceStatus.WAITING) -> None:
        """Back to the front of the queue, to be computed (again) before anyone else."""
        seq.status = status
        self.waiting.appendleft(seq)

    # ---- what the forward pass produced ------------------------------------------------------

    def update_from_output(
        self, batch: ScheduledBatch, run: RunnerOutput
    ) -> tuple[list[StepOutput], StepStats]:
        """Apply the runner's output to the batch's sequences: what each one says this step,
        and the step's counts. One pass over the batch, which the runner already made."""
        outputs: list[StepOutput] = []
        stats = StepStats.of(batch)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if i in run.prompt_logprobs:
                seq.prompt_logprobs_so_far.extend(run.prompt_logprobs[i])
            sampled = run.sampled.get(i)
            if sampled is None:  # a prompt chunk that is not the last
                seq.num_computed_tokens += n
                self.bm.commit(seq)
                continue
            drafted, accepted = run.drafted.get(i, 0), len(sampled) - 1
            seq.cut_draft(0)
            prompt_lp = seq.prompt_logprobs_to_send()  # before the token makes it an output
            # max_tokens 0: prompt log-probs only
            new_tokens, reason = (
                seq.append_tokens(sampled, self.eos_token_ids, self.max_model_len)
                if seq.sampling.max_tokens
                else ([], "length")
            )
            # the KV computed is the row's, less its rejected drafts' (they are rolled back)
            seq.num_computed_tokens = min(
                seq.num_computed_tokens + n - drafted + accepted, seq.num_tokens
            )
            if drafted:
                self.bm.trim(seq)
                self.speculator.verified(seq, drafted, accepted)
                stats.count_draft(drafted, accepted)
            self.bm.commit(seq)
            if self._fork(seq):  # it only carried the prompt for its request's other choices
                continue
            out = StepOutput(
                bus_id=seq.bus_id,
                new_token_ids=new_tokens,
                finish_reason=reason,
                num_prefix_hit_tokens=seq.num_prefix_hit_tokens,
                index=seq.index,
            )
            out.num_draft_tokens, out.num_accepted_tokens = drafted, accepted
            if new_tokens and i in run.logprobs:
                out.logprobs = run.logprobs[i].slice(0, len(new_tokens))
            out.prompt_logprobs = prompt_lp
            if reason is not None and not (self.prefill_only and num_choices(seq.sampling) > 1):
                out.request_finished = self._finish(seq, reason)
            elif self.prefill_only:  # n > 1: even if choice 0 ended, the others fork from its KV
                self.running.remove(seq)  # parked: its blocks stay, leased for the pull
                seq.status = SequenceStatus.PREFILLED
                out.kv_block_ids, out.num_kv_tokens = list(seq.block_table), seq.num_computed_tokens
            outputs.append(out)
        return outputs, stats

    def _ended(self, seq: Sequence) -> str | None:
        return seq.ended_by(self.eos_token_ids, self.max_model_len)

    def _fork(self, seq: Sequence) -> bool:
        """Fork the request's other choices from ``seq`` (choice 0, whose prompt's KV is
        complete and first token sampled) if they are still to fork (``sequence_group.py``).
        True when ``seq`` only carried the prompt for them (its own choice is over) and has
        left: it has nothing to say."""
        group = self.requests[seq.bus_id]
        if not group.unforked or self.prefill_only:  # a prefill worker's: forked after the pull
            return False
        fork = group.fork(seq, self.bm, self._num_slots())
        for child in fork.running:  # they hold their blocks: newest, so first to be preempted
            if self.lora is not None:
                self.lora.share(seq, child)
            self._run(child)
        for child in reversed(fork.queued):  # none yet: computed like preempted sequences
            self._wait_first(child)
        self.seqs.update((child.seq_id, child) for child in fork.running + fork.queued)
        self.block_copies += fork.copies
        if group.needs(seq):
            return False
        self._finish(seq, seq.finish_reason)
        return True

    def _finish(self, seq: Sequence, reason: str | None) -> bool:
        """``seq`` leaves the engine, its blocks freed. True when it was its request's last
        open choice."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.pulling[seq.seq_id]
        self.bm.free_sequence(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        if self.lora is not None:
            self.lora.unpin(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        group = self.requests[seq.bus_id]
        request_finished = group.remove(seq)
        if not group.seqs:  # (choices never forked here, e.g. on a prefill worker, end too)
            del self.requests[seq.bus_id]
            if self.lora is not None and seq.lora_name is not None:
                self.lora.request_ended(seq.lora_name)
        return request_finished
