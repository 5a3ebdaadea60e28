"""How many tokens each sequence may draft: adaptive K from its running acceptance rate.

A draft of k tokens costs the step k more query tokens whatever is accepted; its j-th token is
only worth anything when the j - 1 before it were accepted too. With a running acceptance rate
a (the accepted share of drafted tokens, an exponential average over the sequence's recent
verifications), the chance that draft position j is reached and accepted is about a**j; a
sequence drafts position j only while a**j >= ``min_accept``. When even a < ``min_accept`` it
stops drafting for a pause (1, 2, 4, ... up to ``MAX_PAUSE`` steps: text that will not repeat
costs nothing while paused), then drafts one token to probe again. Text that starts repeating
(an edit reaches a quoted span, a list starts) brings a back up within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest verification in the running acceptance rate
MAX_PAUSE = 32  # steps


@dataclass
class DraftBudget:
    """One sequence's adaptive draft length."""

    max_tokens: int  # K
    min_accept: float
    acceptance: float = 1.0  # optimistic start: a new sequence drafts K tokens
    paused: int = 0  # steps left without drafting
    next_pause: int = 1

    def limit(self) -> int:
        """How many tokens the sequence may draft this step (0: none). Counts a paused step."""
        if self.paused:
            self.paused -= 1
            return 0
        if self.min_accept <= 0.0:
            return self.max_tokens
        k, reach = 0, self.acceptance
        while k < self.max_tokens and reach >= self.min_accept:
            k, reach = k + 1, reach * self.acceptance
        return max(k, 1)  # a probe after a pause drafts one token

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of ``num_drafted`` >= 1 tokens accepted ``num_accepted``."""
        rate = num_accepted / num_drafted
        self.acceptance += SMOOTHING * (rate - self.acceptance)
        if self.min_accept <= 0.0 or self.acceptance >= self.min_accept:
            self.next_pause = 1
            return
        self.paused = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
