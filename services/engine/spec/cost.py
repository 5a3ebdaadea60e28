"""What a draft costs, measured on the engine's own steps.

Verifying k drafts adds k query tokens to a sequence's row. On a GPU at small batch that is
almost free (the step is bound by reading the weights); on a CPU each token adds real work. So
whether a draft pays depends on the machine, and ``adaptive.py`` weighs expected accepted tokens
against this cost.

The cost of a step is not a straight line in its tokens T: on issue 26's CPU a step of 2 or 3
tokens took ~1.15-1.2x a 1-token one and a step of 4 or 5 ~1.7x (the GEMM switches kernels
between 3 and 4 rows). A line fitted through that (the earlier model, least squares over all
steps) over-prices short drafts and under-prices long ones, and its slope swung with every
stalled step on a loaded machine, which turned drafting off where it paid (1.02x against fixed
K's 1.40x). So each step count T keeps its own recent step times, and its cost is their
lower quartile: noise on a shared machine only ever slows a step (2-3x when something else
runs), so the quartile stays on undisturbed steps until three quarters of the window are slowed,
and load that slows every step alike cancels out of the ratios used below.

A draft of k tokens by one of B decoding sequences then costs ``B * (c(B + k) - c(B)) / c(B)``
of that sequence's share of a plain decode step, c(T) being that quartile at T tokens:
interpolated between the measured counts when both B and B + K were measured (batch 1, where
the jumps matter), else a least-squares line through the counts of at least B tokens (a batch
of 8 spreads its steps over 8-40 tokens, too thinly to measure each). It is clipped
to [0, k]: more tokens never make a step cheaper, and a token never costs more than a whole
sequence's share of a plain step. A draft model adds its own pass per draft token, ``d``
seconds over the whole batch (an average of what the proposer measured): ``k * d / c(B)`` more.
Until two step counts have been measured, drafts are taken as free, which drafts fully and so
measures the longer steps.
"""

from __future__ import annotations

from collections import deque

WINDOW = 24  # recent steps kept per step count
MIN_SAMPLES = 3  # steps of a count before its quartile is believed
DRAFT_DECAY = 0.9  # weight the draft pass's average keeps per new measurement


class DraftCost:
    def __init__(self, fixed: float | None = None) -> None:
        self.fixed = fixed  # a per-token cost given by configuration: never measured
        self._steps: dict[int, deque[float]] = {}  # step tokens -> recent seconds
        self._typical: dict[int, float] = {}  # step tokens -> lower quartile, once believed
        self._curve: list[tuple[int, float]] | None = None  # sorted _typical, until a change
        self.draft = 0.0  # seconds of one draft-model pass over the batch (0: n-gram)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step with only decode and verification rows took ``seconds``."""
        if self.fixed is not None:
            return
        window = self._steps.get(num_tokens)
        if window is None:
            window = self._steps[num_tokens] = deque(maxlen=WINDOW)
        window.append(seconds)
        if len(window) >= MIN_SAMPLES:  # one count changes per step: the others are kept
            self._typical[num_tokens] = sorted(window)[(len(window) - 1) // 4]
            self._curve = None

    def observe_draft(self, seconds: float) -> None:
        """Drafting one token took ``seconds`` (a draft model's pass over the batch)."""
        if self.fixed is None:
            old = self.draft or seconds
            self.draft = DRAFT_DECAY * old + (1.0 - DRAFT_DECAY) * seconds

    def extra(self, num_seqs: int, max_tokens: int) -> list[float]:
        """What a draft of k = 0..``max_tokens`` tokens costs one of ``num_seqs`` decoding
        sequences, relative to its share of a plain decode step (0: drafts are free)."""
        if self.fixed is not None:
            return [self.fixed * k for k in range(max_tokens + 1)]
        seqs = max(1, num_seqs)
        # only steps at least this big: a batch of 8 never runs a 1-token step, and a line
        # through batch 1's steps would bend batch 8's
        measured = self._measured()
        curve = [(t, y) for t, y in measured if t >= seqs]
        if len(curve) < 2:  # none yet: all steps, if any, are a better guess than nothing
            curve = measured
        if len(curve) < 2:
            return [0.0] * (max_tokens + 1)
        typical = dict(curve)
        if seqs in typical and seqs + max_tokens in typical:  # measured: between them, the table
            costs = [_between(curve, seqs + k) for k in range(max_tokens + 1)]
        else:  # a batch whose step sizes are spread too thin to measure each: a line
            intercept, slope = _line(curve)
            costs = [intercept + slope * (seqs + k) for k in range(max_tokens + 1)]
        plain = costs[0]
        if plain <= 0.0:
            return [0.0] * (max_tokens + 1)
        return [
            min(max(seqs * (c - plain) / plain, 0.0), float(k)) + k * self.draft / plain
            for k, c in enumerate(costs)
        ]

    def relative(self, num_seqs: int) -> float:
        """What one more query token costs, relative to one of ``num_seqs`` sequences' share
        of a plain decode step (0: drafts are free)."""
        return self.extra(num_seqs, 1)[1]

    def _measured(self) -> list[tuple[int, float]]:
        if self._curve is None:
            self._curve = sorted(self._typical.items())
        return self._curve


def _between(curve: list[tuple[int, float]], t: int) -> float:
    """c(t) interpolated between the measured step sizes around it (t within them)."""
    for (t0, y0), (t1, y1) in zip(curve, curve[1:], strict=False):
        if t0 <= t <= t1:
            return y0 + (y1 - y0) * (t - t0) / (t1 - t0)
    return curve[-1][1]


def _line(curve: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares through the measured step sizes (each already a robust statistic)."""
    n = len(curve)
    mean_t = sum(t for t, _ in curve) / n
    mean_y = sum(y for _, y in curve) / n
    spread = sum((t - mean_t) ** 2 for t, _ in curve)
    slope = max(sum((t - mean_t) * (y - mean_y) for t, y in curve) / spread, 0.0)
    return mean_y - slope * mean_t, slope
