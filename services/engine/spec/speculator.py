"""The engine's side of speculative decoding: who drafts, how much, and what was accepted.

Before each step's scheduling, ``propose`` gives every running sequence about to decode its
draft (``Sequence.spec_token_ids``), asking the proposer only for sequences that may speculate:
the request did not opt out (``SamplingParams.speculate``), it is not guided (structured output
does not speculate: a draft would have to be checked against the grammar token by token, and
the grammar's state rolled back after a rejection), and its adaptive budget allows a token
(``adaptive.py``, weighing its acceptance rate against what a draft costs: ``cost.py``,
fed each decode step's duration by the engine). Where looking for a draft is nearly free
(n-gram), every such sequence looks first, and the budget of the kind of draft found (its match
length: a 1-token match is accepted far less often than a 4-token one) decides how much of it
to verify. A draft never reaches past ``max_tokens`` or the context: k drafts emit up
to k + 1 tokens. After the forward pass, ``verified`` records each verification's outcome.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.spec.adaptive import DraftBudget
from pdserve.services.engine.spec.cost import DraftCost
from pdserve.services.engine.spec.proposer import Proposer


@dataclass
class SpecCounters:
    """Cumulative, vLLM's spec_decode metrics: acceptance rate = accepted / draft tokens, mean
    acceptance length = 1 + accepted / drafts."""

    drafts: int = 0  # verifications of at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepting token j

    def snapshot(self) -> SpecCounters:
        return SpecCounters(
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            accepted_per_pos=list(self.accepted_per_pos),
        )

    def since(self, earlier: SpecCounters) -> SpecCounters:
        """What was counted after ``earlier`` (a snapshot of these counters)."""
        per_pos = list(self.accepted_per_pos)
        for j, count in enumerate(earlier.accepted_per_pos):
            per_pos[j] -= count
        return SpecCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted_tokens=self.accepted_tokens - earlier.accepted_tokens,
            accepted_per_pos=per_pos,
        )

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


@dataclass
class _Budgets:
    """A sequence's adaptive budgets, one per kind of draft, and the one its last draft used."""

    by_kind: dict[int, DraftBudget] = field(default_factory=dict)
    last: tuple[DraftBudget, int] | None = None  # (budget, kind)


class Speculator:
    def __init__(
        self, proposer: Proposer, num_tokens: int, cost: DraftCost, max_model_len: int
    ) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens  # K
        self.cost = cost
        self.max_model_len = max_model_len
        self.counters = SpecCounters(accepted_per_pos=[0] * num_tokens)
        self._budgets: weakref.WeakKeyDictionary[Sequence, _Budgets] = weakref.WeakKeyDictionary()
        # per kind of draft, the acceptance rates of every sequence's recent verifications: a
        # new sequence's budget starts from them, not from a blind prior (a 4-token match of
        # quoted text is accepted ~85% from its first draft on, a 1-token one ~20%)
        self._engine_rates: dict[int, DraftBudget] = {}

    def budget(self, seq: Sequence, kind: int = 0) -> DraftBudget:
        """``seq``'s budget for drafts of ``kind`` (``Proposal.kind``: n-gram match length)."""
        budgets = self._budgets.get(seq)
        if budgets is None:
            budgets = self._budgets[seq] = _Budgets()
        budget = budgets.by_kind.get(kind)
        if budget is None:
            seen = self._engine_rates.get(kind)
            budget = budgets.by_kind[kind] = DraftBudget(self.num_tokens)
            if seen is not None:
                budget.rates, budget.seen = list(seen.rates), list(seen.seen)
        budgets.last = budget, kind
        return budget

    def propose(self, running: list[Sequence]) -> None:
        """Set the draft of each running sequence for the coming step (most get none)."""
        asking: list[Sequence] = []
        limits: list[int] = []
        decoding = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
        cost = self.cost.extra(decoding, self.num_tokens)
        looks_first = self.proposer.looks_first
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
            limit = self._room(seq)
            if limit > 0 and not looks_first:
                limit = min(limit, self.budget(seq).limit(cost))
            if limit > 0:
                asking.append(seq)
                limits.append(limit)
        if not asking:
            return
        for seq, proposal in zip(asking, self.proposer.propose(asking, limits), strict=True):
            if proposal is None or not proposal.token_ids:
                continue
            if looks_first:  # what was found decides how much of it is worth verifying
                k = self.budget(seq, proposal.kind).limit(cost)
                if k:
                    probs = proposal.probs[:k] if proposal.probs is not None else None
                    seq.spec_token_ids, seq.spec_probs = proposal.token_ids[:k], probs
            else:
                seq.spec_token_ids, seq.spec_probs = proposal.token_ids, proposal.probs
        if self.proposer.step_seconds is not None:
            self.cost.observe_draft(self.proposer.step_seconds)

    def _room(self, seq: Sequence) -> int:
        """Tokens ``seq`` may draft this step before its budget: 0 unless it decodes next."""
        sp = seq.sampling
        if seq.num_uncomputed_tokens != 1 or not sp.speculate or sp.guided is not None:
            return 0
        # k drafts emit at most k + 1 tokens, and put k + 1 tokens' positions in the cache
        return min(
            self.num_tokens,
            sp.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens,
        )

    def verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.counters.add(num_drafted, num_accepted)
        budgets = self._budgets.get(seq)
        if budgets is not None and budgets.last is not None:  # the budget this draft came from
            budget, kind = budgets.last
            budget.update(num_drafted, num_accepted)
            seen = self._engine_rates.get(kind)
            if seen is None:
                seen = self._engine_rates[kind] = DraftBudget(self.num_tokens)
            seen.update(num_drafted, num_accepted)
        self.proposer.verified(seq, num_drafted, num_accepted)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
