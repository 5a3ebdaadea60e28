"""The sequences of one request (``sampling.n``): one prefill, then a fork into n sequences.

A request with ``n > 1`` runs as one sequence, choice 0, until its prompt's KV is complete and
choice 0 has its first token: after the last prompt chunk computed here, or when the KV pulled
from a prefill worker is ready (that worker sampled choice 0's first token; a prefill-only
engine never forks). The scheduler then forks choices 1..n-1 (``fork_choice``): each shares the
prompt's full blocks by reference, gets a private copy of the block holding the last prompt
token, and starts one token short of the prompt. Its first step recomputes that token as a
one-token decode row and samples its own first token, so each choice costs one token of compute
and nothing else changes: the sampler, the wire, and exact reproducibility (choice i samples
with ``choice_seed(seed, i)``, so the request's seed reproduces all of them).

``SequenceGroup`` keeps the bookkeeping: which choices are still open, which are still to fork,
and which sequences hold state. Choice 0's sequence may outlive its own choice (its first token
ended it, or it was aborted) while choices remain to be forked from its KV: it carries the
prompt until the fork, then leaves quietly. The scheduler makes every status change; this
module only says who exists and who is still needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.sampling import SamplingParams, choice_seed


def num_choices(sampling: SamplingParams) -> int:
    """The choices a request generates: ``n``, or one when it generates nothing (max_tokens 0:
    prompt log-probs only)."""
    return sampling.n if sampling.max_tokens else 1


def fork_choice(parent: Sequence, index: int) -> Sequence:
    """Choice ``index`` of ``parent``'s request: its prompt, no output yet, no blocks yet.

    It never gathers prompt log-probs: choice 0 carries the request's."""
    sampling = parent.sampling
    if sampling.prompt_logprobs is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=None)
    child = Sequence(
        parent.bus_id,
        parent.token_ids[: parent.num_prompt_tokens],
        sampling,
        choice_seed(parent.seed, index),
        parent.arrival,
        index=index,
    )
    child.num_prefix_hit_tokens = parent.num_prefix_hit_tokens  # the request's prompt's
    child.lora_name = parent.lora_name  # its slot is pinned when it runs (the scheduler's)
    return child


@dataclass
class Fork:
    """What forking a request's choices made: children that hold their blocks and may run at
    once, children with none that wait (in order), and the (source, new) block copies the KV
    cache needs before the next forward pass."""

    running: list[Sequence] = field(default_factory=list)
    queued: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class SequenceGroup:
    bus_id: str
    seqs: dict[int, Sequence]  # by choice index: the sequences that hold state in the engine
    unfinished: set[int]  # choices neither finished nor aborted, forked or not
    unforked: list[int] = field(default_factory=list)  # choices still to fork from choice 0

    @classmethod
    def start(cls, seq: Sequence, n: int) -> SequenceGroup:
        """A new request: its choice 0, and ``n - 1`` more to fork later."""
        return cls(seq.bus_id, {0: seq}, set(range(n)), list(range(1, n)))

    def needs(self, seq: Sequence) -> bool:
        """Still generating its choice, or carrying the prompt's KV for choices still to fork."""
        return seq.index in self.unfinished or (seq.index == 0 and bool(self.unforked))

    def end_choice(self, index: int | None) -> list[Sequence]:
        """Choice ``index`` (None: every choice) is over without an output (aborted, or ended at
        its first token): returns the sequences no longer needed, to drop now."""
        self.unfinished -= set(self.unfinished) if index is None else {index}
        self.unforked = [i for i in self.unforked if i in self.unfinished]
        return [seq for seq in self.seqs.values() if not self.needs(seq)]

    def remove(self, seq: Sequence) -> bool:
        """``seq`` leaves the engine. True when that ends the request's last open choice."""
        del self.seqs[seq.index]
        was_open = seq.index in self.unfinished
        self.unfinished.discard(seq.index)
        return was_open and not self.unfinished

    def fork(self, parent: Sequence, bm: BlockManager, free_slots: int) -> Fork:
        """Fork the choices still to fork from ``parent`` (choice 0: its prompt's KV complete,
        its first token sampled). Up to ``free_slots`` children that get a block for their copy
        may run from the next step; the others wait, to be computed like preempted sequences."""
        fork = Fork()
        for index in self.unforked:
            child = self.seqs[index] = fork_choice(parent, index)
            copy = None
            if len(fork.running) < free_slots:
                copy = bm.fork(parent, child, parent.num_prompt_tokens)
            if copy is None:
                fork.queued.append(child)
                continue
            fork.copies.append(copy)
            child.num_computed_tokens = parent.num_prompt_tokens - 1  # recompute the last one
            fork.running.append(child)
        self.unforked = []
        return fork
