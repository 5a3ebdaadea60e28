"""The names of decide.py's rules, as a ``Decision`` lists them and its reasons tag them
(``[dead-band]``), and the notes a decision collects them in; decide.py's docstring says what
each rule guards against."""

from __future__ import annotations

from dataclasses import dataclass, field

WARMUP = "warm-up"
FEW_REQUESTS = "few-requests"
UNSTEADY = "unsteady"
IDLE_WINDOW = "idle-window"
ZERO_DEMAND = "zero-demand"
FORECAST = "forecast"
BACKLOG = "backlog"
POOL = "pool"
DEAD_BAND = "dead-band"
FALLING = "falling"
COOLDOWN = "cooldown"
STREAK = "scale-down-streak"
ONE_STEP = "one-step"
SURVIVORS = "survivors"
MIN_MAX = "min-max"
BUDGET = "budget"
CORES = "cores"

# the rules that hold a count the arithmetic alone would have moved
GUARDS = frozenset(
    {
        WARMUP,
        IDLE_WINDOW,
        ZERO_DEMAND,
        DEAD_BAND,
        COOLDOWN,
        STREAK,
        ONE_STEP,
        SURVIVORS,
        MIN_MAX,
        BUDGET,
        CORES,
    }
)


@dataclass
class Notes:
    """One decision in the making: what it says, in order, and which rules acted."""

    reasons: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)

    def note(self, rule: str | None, text: str) -> None:
        if rule:
            self.rules.append(rule)
            text += f" [{rule}]"
        self.reasons.append(text)
