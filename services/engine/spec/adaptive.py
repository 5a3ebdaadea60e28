"""How many tokens each sequence drafts: adaptive K from its acceptance and the cost.

A draft of k tokens costs the step k more query tokens whatever is accepted; its j-th token is
only worth anything when the j - 1 before it were accepted too. Acceptance is bursty - a draft
copied from a quoted span is either wrong at once or right for a while - so each sequence keeps
one running rate per draft position: how often the j-th drafted token was accepted when the one
before it was (exponential averages over the sequence's recent verifications). A draft of k
tokens then emits 1 + c1 + c1*c2 + ... + c1*...*ck tokens on average, for 1 + r_k times a
plain step's cost, r_k being what a draft of k tokens costs relative to a plain step
(``cost.py``, measured per step size: not k times one token's cost, since a CPU GEMM's time
jumps between row counts). Each step the sequence
drafts the k in 0..K that emits the most per cost. Where k = 0 wins - text that does not
repeat, on a machine where tokens are not free - it pauses for 1, 2, 4, ... up to
``MAX_PAUSE`` steps, then drafts one token to probe again; text that starts repeating (an edit
reaches a quoted span, a list starts) brings the rates back up within a few steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of the newest verification in a running rate
# a new sequence's prior, between the rates measured on open-ended (17-37%) and input-grounded
# (59-88%) text: 0.8 drafted too long at the start of open-ended answers, which at batch 8 on
# this CPU cost 6% against speculation off (0.5: 2%; perf/README.md)
INITIAL_RATE = 0.5
MAX_PAUSE = 32  # steps


def best_length(rates: list[float], cost: float | Sequence[float]) -> int:
    """The draft length in 0..len(rates) with the most expected tokens per cost, ``rates[j]``
    being the chance that draft token j is accepted when the ones before it were, and
    ``cost[k]`` what a draft of k tokens costs relative to a plain step (a float: per token)."""
    costs = [cost * k for k in range(len(rates) + 1)] if isinstance(cost, float | int) else cost
    best_k, best, emitted, reach = 0, 1.0, 1.0, 1.0
    for k, rate in enumerate(rates, start=1):
        reach *= rate
        emitted += reach
        value = emitted / (1.0 + costs[k])
        if value > best:
            best_k, best = k, value
    return best_k


@dataclass
class DraftBudget:
    """One sequence's adaptive draft length."""

    max_tokens: int  # K
    rates: list[float] = field(default_factory=list)  # per draft position, conditional
    paused: int = 0  # steps left without drafting
    next_pause: int = 1
    probe: bool = False  # the pause just ended: draft one token whatever the estimate says
    # positions whose rate was measured (rates given are taken as measured). A position never
    # reached is taken to do as the one before it: with a blind prior there, a sequence whose
    # 3-token drafts were always accepted never tried a 4th token (its prior value 0.5 made the
    # 4th token look not worth its cost), and acceptance after accepted tokens is bursty - high
    seen: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.seen:
            self.seen = [bool(self.rates)] * self.max_tokens
        if not self.rates:
            self.rates = [INITIAL_RATE] * self.max_tokens

    def estimates(self) -> list[float]:
        """Each position's rate, an unmeasured one's taken from the position before it."""
        out: list[float] = []
        for j, rate in enumerate(self.rates):
            out.append(rate if self.seen[j] or not j else out[-1])
        return out

    def limit(self, cost: float | Sequence[float]) -> int:
        """How many tokens the sequence may draft this step, a draft of k tokens costing
        ``cost[k]`` of a plain step (a float: per token; 0: none). Each call is one step."""
        if self.paused:
            self.paused -= 1
            return 0
        k = best_length(self.estimates(), cost)
        if k:
            self.next_pause = 1
            self.probe = False
            return k
        if self.probe:
            self.probe = False
            return 1
        self.paused = self.next_pause - 1  # this step is the pause's first
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        self.probe = True
        return 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of ``num_drafted`` >= 1 tokens accepted the first ``num_accepted``:
        positions before it were reached and accepted, the one after them reached and not."""
        for j in range(min(num_accepted + 1, num_drafted)):
            hit = 1.0 if j < num_accepted else 0.0
            if not self.seen[j]:  # first measurement: start from what was assumed there
                self.rates[j] = self.estimates()[j]
                self.seen[j] = True
            self.rates[j] += SMOOTHING * (hit - self.rates[j])
