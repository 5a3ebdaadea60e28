"""Continuous batching with a token budget per step, chunked prefill and preemption.

Each step first serves running sequences oldest-first (one token for a decode, the next chunk for
a prompt still being prefilled), then admits waiting ones in arrival order while sequence slots,
budget and blocks last. Admission has one policy, ``fits``: the blocks a sequence needs, plus a
little headroom once others are running, must be free. A sequence whose prompt KV comes from a
prefill worker (``remote_kv``) is admitted by the same policy: its blocks are reserved and it is
handed out as a pull (``ScheduledBatch.pulls``) instead of being computed; it costs no token
budget. When a running sequence cannot get a block, the newest running sequence is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later.

A running sequence with a speculative draft (``services/engine/spec``) asks for 1 + k tokens:
its last one and the k drafted after it. The draft is cut to the token budget and to blocks
that no later running sequence may need, so speculation never causes a preemption.

The other choices of a request (``sampling.n > 1``) join when the engine forks them from choice 0
(``add_forked``): straight into the running batch when a sequence slot is free (their blocks are
already theirs), else at the front of the queue, to be computed like a preempted sequence.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (one new token each) first, then prefill chunks
    num_new_tokens: list[int]
    num_decodes: int
    pulls: list[Sequence] = field(default_factory=list)  # blocks just reserved for remote KV
    # after the decodes: rows verifying a draft (1 + len(seq.spec_token_ids) tokens each)
    num_verifies: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pulling: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV, by seq_id
        self.num_preemptions = 0
        # Admission keeps a little headroom so running decodes can grow without instant preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self._blocked: Sequence | None = None  # head of the queue last logged as not fitting

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def requeue_first(self, seq: Sequence) -> None:
        """Back to the front of the queue, to be computed here (a failed pull to recompute)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def start_running(self, seq: Sequence) -> None:
        """A pulled sequence: its KV is in its blocks now; it joins the batch."""
        del self.pulling[seq.seq_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_free_slot(self, joining: int = 0) -> bool:
        """May one more sequence run (or pull) beside ``joining`` others, within
        ``max_num_seqs``?"""
        return len(self.running) + len(self.pulling) + joining < self.max_num_seqs

    def add_forked(self, running: list[Sequence], queued: list[Sequence]) -> None:
        """Forked choices: ``running`` hold their blocks and join the batch (newest, so first
        to be preempted); ``queued`` have none and wait at the front of the queue, in order."""
        for seq in running:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for seq in reversed(queued):
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pulling)

    def fits(self, num_blocks: int) -> bool:
        """The admission policy: may a new sequence take ``num_blocks`` free blocks now?"""
        busy = self.running or self.pulling
        return num_blocks + (self.watermark_blocks if busy else 0) <= self.bm.num_free_blocks

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        pulls: list[Sequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.spec_token_ids:
                self._fit_draft(seq, budget, later=len(self.running) - i - 1)
            n = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append((seq, n))
            budget -= n
            i += 1

        while (
            not preempted
            and self.waiting
            and len(self.running) + len(self.pulling) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.remote_kv:
                if not self._admit_pull(seq):
                    break
                pulls.append(seq)
                continue
            if budget <= 0:
                break
            if not seq.block_table and not seq.needs_prompt_logprobs:  # those score every token
                seq.num_computed_tokens = self.bm.match_prefix(seq)
                seq.num_prefix_hit_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.fits(self.bm.blocks_needed(seq, seq.num_computed_tokens + n)):
                self._unmatch(seq)
                self._log_blocked(seq)
                break
            self.waiting.popleft()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

        if not scheduled and not pulls:
            return None
        # Decode attention serves q_len == 1 rows: they come first, then verification rows
        # (attended as a group of their own), then prefill chunks.
        scheduled.sort(key=lambda item: 1 if item[0].spec_token_ids else 0 if item[1] == 1 else 2)
        num_verifies = sum(1 for s, _ in scheduled if s.spec_token_ids)
        num_decodes = sum(1 for s, n in scheduled if n == 1 and not s.spec_token_ids)
        return ScheduledBatch(
            [s for s, _ in scheduled], [n for _, n in scheduled], num_decodes, pulls, num_verifies
        )

    def _fit_draft(self, seq: Sequence, budget: int, later: int) -> None:
        """Cut ``seq``'s draft (``services/engine/spec``) to the step's token budget and to the
        blocks no one else may need this step: ``later`` running sequences each may need one.
        A draft never preempts anyone; one that does not fit at all is dropped."""
        base = seq.num_computed_tokens + seq.num_uncomputed_tokens
        bs = self.bm.block_size
        blocks = max(len(seq.block_table), -(-base // bs))
        spare = self.bm.num_free_blocks - self.bm.blocks_needed(seq, base) - later
        room = min(len(seq.spec_token_ids), budget - seq.num_uncomputed_tokens,
                   (blocks + max(0, spare)) * bs - base)  # fmt: skip
        if room <= 0:
            seq.spec_token_ids, seq.spec_probs = [], None
        elif room < len(seq.spec_token_ids):
            seq.spec_token_ids = seq.spec_token_ids[:room]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:room]

    def _admit_pull(self, seq: Sequence) -> bool:
        """Reserve blocks for the prompt a prefill worker computed; False when they do not fit."""
        if not self.fits(self.bm.blocks_needed(seq, seq.num_prompt_tokens)):
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

    def _unmatch(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.num_prefix_hit_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids, seq.spec_probs = [], None
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def park(self, seq: Sequence) -> None:
        """Stop scheduling a sequence but keep its blocks (a prefill worker's leased KV)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (it finished, or was released)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.pulling[seq.seq_id]
        self.bm.free_sequence(seq)
