"""Continuous batching with a token budget per step, chunked prefill and preemption.

Each step first serves running sequences oldest-first (one token for a decode, the next chunk for
a prompt still being prefilled), then admits waiting ones while budget, sequence slots and blocks
last. When a running sequence cannot get a block, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (one new token each) first, then prefill chunks
    num_new_tokens: list[int]
    num_decodes: int

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
        self.num_preemptions = 0
        # Admission keeps a little headroom so running decodes can grow without instant preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks and KV are already in place (e.g. pulled from a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
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
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_computed_tokens = self.bm.match_prefix(seq)
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            n = min(seq.num_uncomputed_tokens, budget)
            needed = self.bm.blocks_needed(seq, seq.num_computed_tokens + n)
            headroom = self.watermark_blocks if self.running else 0
            if needed + headroom > self.bm.num_free_blocks:
                self._unmatch(seq)
                break
            self.waiting.popleft()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

        if not scheduled:
            return None
        # Decode attention serves q_len == 1 rows; order them first.
        scheduled.sort(key=lambda item: item[1] != 1)
        num_decodes = sum(1 for _, n in scheduled if n == 1)
        return ScheduledBatch([s for s, _ in scheduled], [n for _, n in scheduled], num_decodes)

    def _unmatch(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def park(self, seq: Sequence) -> None:
        """Stop scheduling a sequence but keep its blocks (a prefill worker's leased KV)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished, aborted or parked) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)
