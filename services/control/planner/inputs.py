"""What the planner reads and keeps: a metrics window (the gateway's view of one adjustment
interval, each worker's load and age included, the warm pool and the start latencies measured),
worker counts, the limits (min/max per role, the cost of a worker and the budget), the planner's
tunables, and the state it carries between windows (its corrections, streaks and forecasters).
Plain frozen dataclasses: whoever collects metrics builds them, ``decide`` only reads them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pdserve.services.control.planner.forecast import Holt, HoltGains

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
    loading: bool = False  # started, not registered yet: never drained, its age means nothing


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
class MetricsWindow:
    """What the gateway saw over one adjustment interval."""

    duration_s: float
    requests: int  # requests that arrived in the window
    mean_isl: float = 0.0
    mean_osl: float = 0.0
    ttft_ms: float | None = None  # at the SLO's percentile; None without samples
    itl_ms: float | None = None
    workers: tuple[WorkerSample, ...] = ()
    # the warm pool (standby workers, never routed to): all of them, and those loaded and ready
    # to serve at once; neither is in ``workers`` nor in the planner's current counts
    pool: Counts = Counts(0, 0)
    pool_ready: Counts = Counts(0, 0)
    # seconds from "start one" to serving, as measured by whoever runs workers (None: not yet)
    cold_start_s: float | None = None  # a cold start: the model loads
    warm_start_s: float | None = None  # a promotion from the warm pool

    @property
    def request_rate(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def of(self, role: str) -> list[WorkerSample]:
        return [w for w in self.workers if w.role == role]


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
    steady_band: float = 0.25  # a rate moved more than this in a window: corrections kept
    prefill_cv2: float = 1.0  # service-time variability assumed by the TTFT queue model
    # the forecasters (forecast.py): the rate follows a surge at once, the lengths move slowly
    rate_gains: HoltGains = HoltGains(alpha=0.4, beta=0.1, surge_sigmas=3.0)
    length_gains: HoltGains = HoltGains(alpha=0.5, beta=0.1)
    # start latencies until the window brings measured ones
    cold_start_s: float = 60.0
    warm_start_s: float = 2.0
    # the warm pool in the loop: serving is sized for a promotion's horizon and the pool holds
    # what a cold start's horizon needs beyond it (False: serving for the cold horizon, no pool
    # above the floor)
    use_pool: bool = True
    pool_z: float = 0.25  # the pool covers the forecast up to this many standard errors
    # --warm-*-workers: the reserve the pool keeps, less serving workers beyond the need (budget
    # permitting: serving comes first)
    pool_floor: Counts = Counts(0, 0)
    # flapping: a scale-up within this many replacement times (a cold start plus a window) of
    # the role's last scale-down undoes it; each one at least doubles the role's cooldown (no
    # scale-down until the load has not needed all its workers for that long), from that span
    # up to ``cooldown_max`` of them; the cooldown halves every ``cooldown_half_life_s``
    flap_starts: float = 3.0
    cooldown_max: float = 8.0
    cooldown_half_life_s: float = 1800.0
    down_step: int = 1  # serving workers one scale-down removes per role (0: as many as fit)
    # the CPUs of a host the budget oversubscribes (--autoscale-max-cpus above them): workers
    # then split these cores, and a count is fitted to them (guards.fit_cores); None: no such
    host_cpus: float | None = None


@dataclass(frozen=True)
class RoleState:
    """What the planner remembers of one role between windows."""

    down_streak: int = 0  # consecutive windows that asked for fewer serving workers
    since_up_s: float = math.inf  # since its serving count last grew
    since_down_s: float = math.inf  # ... and last shrank
    since_needed_s: float = math.inf  # since the load last needed all its serving workers
    cooldown_s: float = 0.0  # no scale-down until the load has not needed them this long
    pool_since_up_s: float = math.inf  # since its warm pool last grew
    pool_streak: int = 0  # consecutive windows that asked for a smaller warm pool

    def aged(self, seconds: float, half_life_s: float) -> RoleState:
        """One window later: the clocks advance, the cooldown decays."""
        return dataclasses.replace(
            self,
            since_up_s=self.since_up_s + seconds,
            since_down_s=self.since_down_s + seconds,
            since_needed_s=self.since_needed_s + seconds,
            pool_since_up_s=self.pool_since_up_s + seconds,
            cooldown_s=self.cooldown_s * 0.5 ** (seconds / half_life_s),
        )


@dataclass(frozen=True)
class PlannerState:
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    prefill: RoleState = RoleState()
    decode: RoleState = RoleState()
    # the forecasters of the arrival rate (req/s), the mean ISL and the mean OSL
    rate: Holt = Holt()
    isl: Holt = Holt()
    osl: Holt = Holt()

    def of(self, role: str) -> RoleState:
        return getattr(self, role)
