"""The simulator's inputs and outputs: the request-rate schedule (e.g. a ramp low -> high ->
low), the fleet's settings, and the result (every request's timings, one record per window, the
planner's decisions, worker-seconds and scaling actions) with the SLO arithmetic over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.services.control.planner.decide import Decision
from pdserve.services.control.planner.inputs import Counts
from pdserve.services.control.planner.profile import interp
from pdserve.services.control.planner.sim_workers import SimRequest
from pdserve.services.control.planner.workload import SLO


@dataclass(frozen=True)
class RateSchedule:
    points: tuple[tuple[float, float], ...]  # (seconds, requests/s), piecewise linear

    @property
    def duration(self) -> float:
        return self.points[-1][0]

    @property
    def peak(self) -> float:
        return max(r for _, r in self.points)

    def rate(self, t: float) -> float:
        return interp([p[0] for p in self.points], [p[1] for p in self.points], t)

    @classmethod
    def constant(cls, rate: float, duration_s: float) -> RateSchedule:
        return cls(((0.0, rate), (duration_s, rate)))

    @classmethod
    def ramp(cls, low: float, high: float, duration_s: float) -> RateSchedule:
        """low for the first 10%, up to high by 40%, high until 60%, down to low by 90%."""
        d = duration_s
        shape = ((0, low), (0.1, low), (0.4, high), (0.6, high), (0.9, low), (1.0, low))
        return cls(tuple((f * d, r) for f, r in shape))


@dataclass(frozen=True)
class SimConfig:
    window_s: float = 30.0  # the planner's adjustment interval
    startup_s: float = 60.0  # from "start a worker" to its first request (model load)
    kv_transfer_ms: float = 2.0
    prefill: int = 1  # the fleet at t = 0 (ready)
    decode: int = 1
    aggregated: int = 0  # > 0: this many workers doing both phases (prefill = decode = 0)
    chunk_tokens: int = 2048  # aggregated workers' prefill chunk per step
    tail_s: float = 300.0  # after the schedule ends, how long in-flight requests may finish
    seed: int = 0


@dataclass(frozen=True)
class WindowRecord:
    t: float  # end of the window
    request_rate: float  # observed
    ttft_ms: float | None
    itl_ms: float | None
    serving: Counts  # active workers (aggregated workers count as decode)
    live_cost: float  # every worker that costs: starting, active, draining
    desired: Counts | None
    rules: tuple[str, ...] = ()


@dataclass
class SimResult:
    requests: list[SimRequest]
    windows: list[WindowRecord]
    decisions: list[Decision]
    worker_seconds: dict[str, float]  # per role, within the schedule's duration
    scale_actions: int  # role count changes the planner asked for
    max_cost: float  # the most the live fleet ever cost
    duration_s: float

    def _span(self, t0: float, t1: float) -> list[SimRequest]:
        return [r for r in self.requests if t0 <= r.arrival < t1]

    def attainment(self, slo: SLO, t0: float = 0.0, t1: float = math.inf) -> float:
        """Share of requests arriving in [t0, t1) that finished within both SLO targets."""
        reqs = self._span(t0, t1)
        good = sum(1 for r in reqs if r.done == r.done and slo.met_by(r.ttft_ms, r.itl_ms))
        return good / len(reqs) if reqs else 1.0

    def goodput(self, slo: SLO, t0: float = 0.0, t1: float | None = None) -> float:
        t1 = self.duration_s if t1 is None else t1
        reqs = self._span(t0, t1)
        good = sum(1 for r in reqs if r.done == r.done and slo.met_by(r.ttft_ms, r.itl_ms))
        return good / (t1 - t0)

    def latency(self, metric: str, q: float, t0: float = 0.0, t1: float = math.inf) -> float:
        """The q-quantile of per-request "ttft_ms" or "itl_ms" (unfinished requests: inf)."""
        values = sorted(
            getattr(r, metric) if r.done == r.done else math.inf for r in self._span(t0, t1)
        )
        return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else 0.0
