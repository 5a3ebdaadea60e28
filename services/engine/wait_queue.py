"""The order a worker serves waiting requests in: ``--scheduling-policy`` (``shared/
scheduling_options.py``), the same on prefill and decode workers.

``fcfs``: arrival order; a sequence sent back (preempted, or its pull failed and it is recomputed
here, or a forked choice) goes before everyone, as it always has.

``priority``: vLLM's request ``priority``, lower first, then arrival. Sent-back sequences take
their own place by the same rank: a preempted low-priority sequence does not jump a high-priority
one that waits. Starvation is bounded by aging: a waiting sequence gains one priority level per
``--priority-aging-s`` seconds it has waited. Its effective priority at time t is
``priority - (t - arrival) / aging``, and since the t term is the same for every sequence the
order never changes while they wait: the rank ``priority * aging + arrival`` is fixed at arrival
(a priority p + 1 request that has waited ``aging`` seconds ties with a fresh priority p one). So
the queue is kept sorted by insertion (``bisect``), and nothing is re-sorted per step.

Under priority the running list is kept by rank too (a step serves it in order), and a running
sequence still prefilling skips its chunk while the head of the queue outranks it: a
high-priority arrival is admitted at the next step, not after every admitted prompt's chunks.

On the decode side the same rank orders the admission of pulls (the KV of the better-ranked
request is reserved, and so pulled, first) and picks preemption victims: the worst rank among
those still to run this step (lowest priority, latest arrival), where fcfs takes the newest.

**Late prompts** (``--prompt-deadline-ms``, fcfs only): a prompt still without its first token
that has waited longer than the deadline goes behind every prompt that has not, in the order
they fell late. Under overload first come, first served makes every request in the queue miss a
TTFT target once the queue holds more than a target's worth of work; serving the prompts that
can still make it first keeps as many on time as the worker's speed allows, and the late ones,
late whatever happens, are served whenever no on-time prompt waits (so under overload that lasts,
they wait until it ends: the planner's job). The queue is in arrival order, so the late are
always at its head and ``demote_late`` moves them in O(moved). A sequence that has a token
already (a preempted decode, a pull's first token from the prefill worker) is never late.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from pdserve.services.engine.sequence import Sequence


class WaitQueue:
    """WAITING and PREEMPTED sequences, the one to admit next first."""

    def __init__(
        self, policy: str = "fcfs", aging_s: float = 0.0, prompt_deadline_s: float = 0.0
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        if prompt_deadline_s > 0 and policy != "fcfs":
            raise ValueError("a prompt deadline orders an fcfs queue only")
        self.by_priority = policy == "priority"
        self.aging_s = aging_s
        self.prompt_deadline_s = prompt_deadline_s  # 0: no prompt is ever late
        self._fifo: deque[Sequence] = deque()
        self._late: deque[Sequence] = deque()  # past the deadline, behind every _fifo sequence
        self.num_late = 0  # prompts that fell late, ever (a counter for the worker's metrics)
        # priority: (rank, tie-break, sequence), ascending
        self._sorted: list[tuple[tuple[float, float], int, Sequence]] = []
        self._ties = itertools.count()

    def rank(self, seq: Sequence) -> tuple[float, float]:
        """Lower is served first (and preempted last); see the module docstring."""
        p = seq.sampling.priority
        if self.aging_s > 0:
            return (p * self.aging_s + seq.arrival, seq.arrival)
        return (float(p), seq.arrival)

    def append(self, seq: Sequence) -> None:
        """A sequence that arrives."""
        if self.by_priority:
            self._insert(seq)
        else:
            self._fifo.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        """A sequence sent back to be computed (again): first under fcfs, by rank otherwise."""
        if self.by_priority:
            self._insert(seq)
        else:
            self._fifo.appendleft(seq)

    def demote_late(self, now: float) -> None:
        """Move the prompts at the head that have waited past the deadline behind the others
        (see the module). Called before each admission; O(1) when none is late."""
        if self.prompt_deadline_s <= 0:
            return
        fifo, cutoff = self._fifo, now - self.prompt_deadline_s
        while fifo and fifo[0].arrival < cutoff and _awaits_first_token(fifo[0]):
            self._late.append(fifo.popleft())
            self.num_late += 1

    def _insert(self, seq: Sequence) -> None:
        bisect.insort(self._sorted, (self.rank(seq), next(self._ties), seq), key=_by_order)

    def __getitem__(self, i: int) -> Sequence:
        """``[0]``: the head, next to admit."""
        if self.by_priority:
            return self._sorted[i][2]
        return self._fifo[i] if i < len(self._fifo) else self._late[i - len(self._fifo)]

    def popleft(self) -> Sequence:
        if self.by_priority:
            return self._sorted.pop(0)[2]
        return self._fifo.popleft() if self._fifo else self._late.popleft()

    def remove(self, seq: Sequence) -> None:
        if not self.by_priority:
            (self._fifo if seq in self._fifo else self._late).remove(seq)
            return
        for i, (_, _, queued) in enumerate(self._sorted):
            if queued is seq:
                del self._sorted[i]
                return
        raise ValueError(f"{seq.seq_id} is not waiting")

    def __len__(self) -> int:
        return len(self._sorted) if self.by_priority else len(self._fifo) + len(self._late)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Sequence]:
        if self.by_priority:
            return (seq for _, _, seq in self._sorted)
        return itertools.chain(self._fifo, self._late)

    def place(self, running: list[Sequence], seq: Sequence) -> None:
        """Add ``seq`` to the running list, which a step serves in order: last under fcfs
        (oldest first), by rank under priority (a high-priority prompt's chunks go first)."""
        if self.by_priority:
            bisect.insort(running, seq, key=self.rank)
        else:
            running.append(seq)

    def defers(self, seq: Sequence) -> bool:
        """Under priority, whether running ``seq``'s next prompt chunk waits this step: it is
        still prefilling and the head of the queue outranks it, so the step's token budget
        goes to admitting the head instead (a decode's one token never waits). Without it a
        high-priority arrival would wait for every admitted prompt's chunks to finish."""
        if not self._sorted or seq.num_uncomputed_tokens <= 1:
            return False
        rank, _, head = self._sorted[0]
        return not head.remote_kv and self.rank(seq) > rank  # (a pull takes no token budget)

    def victim(self, running: list[Sequence], start: int) -> Sequence:
        """The running sequence to preempt for room, among ``running[start:]`` (those before
        have their rows in this step's batch already): the newest under fcfs, else the worst
        rank. A scan only when a preemption is due, never per step."""
        if not self.by_priority:
            return running[-1]
        return max(running[start:], key=self.rank)


def _awaits_first_token(seq: Sequence) -> bool:
    """Whether ``seq``'s TTFT is still to come: a prompt of its own, no token yet."""
    return not seq.remote_kv and seq.num_output_tokens == 0


def _by_order(item: tuple[tuple[float, float], int, Sequence]) -> tuple[tuple[float, float], int]:
    return item[0], item[1]
