"""What the planner reads and keeps: a metrics window (the gateway's view of one adjustment
interval, each worker's load and age included), worker counts, the limits (min/max per role, the
cost of a worker and the budget), the planner's tunables, and the state it carries between windows.
Plain frozen dataclasses: whoever collects metrics builds them, ``decide`` only reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSample:
    """One worker as the window saw it (from its load reports)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    age_s: float  # since it registered and started serving
    kv_usage: float = 0.0  # used / total KV blocks, 0..1
    queue: int = 0  # requests waiting
    running: int = 0  # requests being served (a decode worker's batch)


@dataclass(frozen=True)
class MetricsWindow:
    """What the gateway saw over one adjustment interval."""

    duration_s: float
    requests: int  # requests that arrived in the window
    mean_isl: float = 0.0
    mean_osl: float = 0.0
    ttft_ms: float | None = None  # at the SLO's percentile; None without samples
    itl_ms: float | None = None
    workers: tuple[WorkerSample, ...] = ()

    @property
    def request_rate(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def of(self, role: str) -> list[WorkerSample]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class Counts:
    prefill: int
    decode: int

    def of(self, role: str) -> int:
        return getattr(self, role)

    def with_(self, role: str, n: int) -> Counts:
        return dataclasses.replace(self, **{role: n})

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Limits:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    prefill_cost: float = 1.0  # GPUs (or CPUs) one prefill worker takes
    decode_cost: float = 1.0
    budget: float | None = None  # total GPUs (or CPUs); None = only the max counts bind
    unit: str = "GPU"

    def __post_init__(self) -> None:
        for role in ROLES:
            if not 0 <= self.min_of(role) <= self.max_of(role):
                raise ValueError(f"{role}: need 0 <= min <= max")
            if self.cost_of(role) <= 0:
                raise ValueError(f"{role}: a worker's cost must be positive")
        floor = self.cost(Counts(self.min_prefill, self.min_decode))
        if self.budget is not None and floor > self.budget:
            raise ValueError(
                f"the minimum fleet costs {floor:g} {self.unit} > budget {self.budget:g}"
            )

    def min_of(self, role: str) -> int:
        return getattr(self, f"min_{role}")

    def max_of(self, role: str) -> int:
        return getattr(self, f"max_{role}")

    def cost_of(self, role: str) -> float:
        return getattr(self, f"{role}_cost")

    def cost(self, counts: Counts) -> float:
        return sum(counts.of(r) * self.cost_of(r) for r in ROLES)


@dataclass(frozen=True)
class PlannerConfig:
    warmup_s: float = 60.0
    min_requests: int = 10
    kv_saturation: float = 0.8  # llm-d's mark: a replica at this KV usage is saturated
    queue_saturation: int = 5  # ... or with this many requests waiting
    dead_band: float = 0.1
    scale_down_windows: int = 2
    correction_bounds: tuple[float, float] = (0.25, 4.0)  # one odd window cannot 10x the fleet
    prefill_cv2: float = 1.0  # service-time variability assumed by the TTFT queue model
    trend_windows: float = 1.0  # a rising rate is planned this many windows ahead (0: constant)


@dataclass(frozen=True)
class PlannerState:
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    prefill_down_streak: int = 0  # consecutive windows that asked for fewer
    decode_down_streak: int = 0
    last_rate: float | None = None  # the previous window's request rate, for the trend
