"""How many tokens each sequence drafts: adaptive K from its acceptance rate and the cost.

A draft of k tokens costs the step k more query tokens whatever is accepted; its j-th token is
only worth anything when the j - 1 before it were accepted too. With a running acceptance rate
a (the accepted share of drafted tokens, an exponential average over the sequence's recent
verifications), a draft of k tokens emits 1 + a + a**2 + ... + a**k tokens on average, for
1 + r * k times a plain step's cost, r being a draft token's relative cost (``cost.py``). Each
step the sequence drafts the k in 0..K that emits the most per cost. Where k = 0 wins - text
that does not repeat, on a machine where tokens are not free - it pauses for 1, 2, 4, ... up to
``MAX_PAUSE`` steps, then drafts one token to probe again; text that starts repeating (an edit
reaches a quoted span, a list starts) brings a back up within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest verification in the running acceptance rate
INITIAL_ACCEPTANCE = 0.8  # a new sequence drafts as if most drafts were accepted
MAX_PAUSE = 32  # steps


def best_length(acceptance: float, max_tokens: int, cost: float) -> int:
    """The draft length in 0..max_tokens with the most expected tokens per cost."""
    best_k, best, emitted, reach = 0, 1.0, 1.0, 1.0
    for k in range(1, max_tokens + 1):
        reach *= acceptance
        emitted += reach
        value = emitted / (1.0 + cost * k)
        if value > best:
            best_k, best = k, value
    return best_k


@dataclass
class DraftBudget:
    """One sequence's adaptive draft length."""

    max_tokens: int  # K
    acceptance: float = INITIAL_ACCEPTANCE
    paused: int = 0  # steps left without drafting
    next_pause: int = 1
    probe: bool = False  # the pause just ended: draft one token whatever the estimate says

    def limit(self, cost: float) -> int:
        """How many tokens the sequence may draft this step, a draft token costing ``cost`` of
        a plain step (0: none). Each call is one step."""
        if self.paused:
            self.paused -= 1
            return 0
        k = best_length(self.acceptance, self.max_tokens, cost)
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
        """A verification of ``num_drafted`` >= 1 tokens accepted ``num_accepted``."""
        self.acceptance += SMOOTHING * (num_accepted / num_drafted - self.acceptance)
