"""What a draft token costs, measured on the engine's own steps.

Verifying k drafts adds k query tokens to a sequence's row. On a GPU at small batch that is
almost free (the step is bound by reading the weights); on a CPU each token adds real work (a
5-token row of SmolLM2-135M takes about twice a 1-token one here). So whether a draft pays
depends on the machine, and ``adaptive.py`` weighs expected accepted tokens against this cost.

The model: a forward pass of T tokens over B decoding sequences takes ``a + b * T`` seconds,
fitted by exponentially weighted least squares over steps with no prefill chunk (their cost is
of another kind). One more draft token then costs ``b / (a / B + b)`` of a sequence's share of
a plain decode step: the relative cost ``adaptive.py`` uses. A draft model adds a pass of its
own per draft token, ``d`` seconds over the whole batch (an average of what the proposer
measured), and then a draft token costs ``(b + d / B) / (a / B + b)``. Outliers (a step stalled by
something else on the machine) are clipped to a few times the prediction; until the steps have
varied enough in T to separate a from b, the cost is taken as 0, which drafts fully and so
creates that variation.
"""

from __future__ import annotations

DECAY = 0.98  # weight kept by past steps per new one (~50 steps of memory)
MIN_SPREAD = 0.25  # weighted variance of T below which b is not re-estimated
CLIP = 3.0
DRAFT_DECAY = 0.9  # weight the draft pass's average keeps per new measurement


class DraftCost:
    def __init__(self, fixed: float | None = None) -> None:
        self.fixed = fixed  # a cost given by configuration: never measured
        self._w = self._t = self._y = self._tt = self._ty = 0.0
        self.a = 0.0
        self.b = 0.0
        self.draft = 0.0  # seconds of one draft-model pass over the batch (0: n-gram)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step with only decode and verification rows took ``seconds``."""
        if self.fixed is not None:
            return
        if self.b > 0.0:  # a stalled step would drag the fit: clip it to the plausible
            expected = self.a + self.b * num_tokens
            seconds = min(max(seconds, expected / CLIP), expected * CLIP)
        t, y = float(num_tokens), seconds
        self._w = DECAY * self._w + 1.0
        self._t = DECAY * self._t + t
        self._y = DECAY * self._y + y
        self._tt = DECAY * self._tt + t * t
        self._ty = DECAY * self._ty + t * y
        mean_t = self._t / self._w
        spread = self._tt / self._w - mean_t * mean_t
        if spread < MIN_SPREAD:
            return
        b = (self._ty / self._w - mean_t * self._y / self._w) / spread
        self.b = max(b, 0.0)
        self.a = max(self._y / self._w - self.b * mean_t, 0.0)

    def observe_draft(self, seconds: float) -> None:
        """Drafting one token took ``seconds`` (a draft model's pass over the batch)."""
        if self.fixed is None:
            old = self.draft or seconds
            self.draft = DRAFT_DECAY * old + (1.0 - DRAFT_DECAY) * seconds

    def relative(self, num_seqs: int) -> float:
        """What one more query token costs, relative to one of ``num_seqs`` sequences' share
        of a plain decode step (0: drafts are free)."""
        if self.fixed is not None:
            return self.fixed
        if self.b <= 0.0:
            return 0.0
        seqs = max(1, num_seqs)
        return (self.b + self.draft / seqs) / (self.a / seqs + self.b)
