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
    def ramp(
        cls, low: float, high: float, duration_s: float, steepness: float = 1.0
    ) -> RateSchedule:
        """low for the first 10%, up to high by 40%, high until 60%, down to low by 90%. A
        ``steepness`` s > 1 takes the rise and the fall s times as fast, about the same peak
        (high from 40% to 60%): the rise starts at 40 - 30/s %, the fall ends at 60 + 30/s %."""
        if steepness < 1:
            raise ValueError("steepness >= 1 (the rise and fall fill 30% of the ramp each at 1)")
        rise = 0.3 / steepness
        low_until, low_from = 0.4 - rise, 0.6 + rise
        shape = ((0, low), (low_until, low), (0.4, high), (0.6, high), (low_from, low), (1, low))
        return cls(tuple((f * duration_s, r) for f, r in shape))

    def ramp_phases(self) -> tuple[tuple[str, float, float], ...]:
        """A ramp's phases as (name, start s, end s): low, rise, peak, fall, low again."""
        t = [p[0] for p in self.points]
        names = ("low", "rise", "peak", "fall", "low again")
        return tuple((n, a, b) for n, a, b in zip(names, t, t[1:], strict=False))

    @classmethod
    def sawtooth(
        cls, low: float, high: float, half_period_s: float, duration_s: float
    ) -> RateSchedule:
        """From low up to high in ``half_period_s``, back down in as long, and again until
        ``duration_s``: the load turns every ``half_period_s``."""
        points, t, up = [(0.0, low)], 0.0, True
        while t < duration_s - 1e-9:
            t = min(duration_s, t + half_period_s)
            points.append((t, high if up else low))
            up = not up
        return cls(tuple(points))


@dataclass(frozen=True)
class SimConfig:
    window_s: float = 10.0  # the planner's adjustment interval (--autoscale-interval's default)
    startup_s: float = 60.0  # from "start a worker" to its first request (model load)
    kv_transfer_ms: float = 2.0
    prefill: int = 1  # the fleet at t = 0 (ready)
    decode: int = 1
    aggregated: int = 0  # > 0: this many workers doing both phases (prefill = decode = 0)
    chunk_tokens: int = 2048  # aggregated workers' prefill chunk per step
    # prefill workers' --prompt-deadline-ms, in s (0: arrival order; sim_workers.py)
    prompt_deadline_s: float = 0.0
    tail_s: float = 300.0  # after the schedule ends, how long in-flight requests may finish
    seed: int = 0
    promote_s: float = 1.0  # from a promotion (SIGUSR1) to a pooled worker's first request
    pool: Counts = Counts(0, 0)  # the warm pool at t = 0 (loaded)
    # an arrival trace (s from the start, ascending) replayed in place of the schedule's Poisson
    # draws: the very arrivals a real run had, so that both meet the same bursts
    arrivals: tuple[float, ...] = ()


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
    pool: Counts = Counts(0, 0)  # pooled workers after the decision (loading ones included)
    forecast: float | None = None  # the rate the decision planned for (req/s)


@dataclass
class SimResult:
    requests: list[SimRequest]
    windows: list[WindowRecord]
    decisions: list[Decision]
    worker_seconds: dict[str, float]  # per role, within the schedule's duration
    scale_actions: int  # role count changes the planner asked for
    max_cost: float  # the most the live fleet ever cost
    duration_s: float
    pool_seconds: float = 0.0  # of worker_seconds, spent in the warm pool
    pool_actions: int = 0  # pool size changes

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

    def reversals(self, within_s: float) -> int:
        """Flaps: times a role's asked-for count went up again within ``within_s`` of going
        down (the workers removed had to come back)."""
        flaps = 0
        for role in ("prefill", "decode"):
            last: tuple[float, int] | None = None  # (when, direction) of the last change
            before = None
            for w in self.windows:
                if w.desired is None:
                    continue
                now = w.desired.of(role)
                if before is not None and now != before:
                    sign = 1 if now > before else -1
                    if last is not None and sign > last[1] and w.t - last[0] <= within_s:
                        flaps += 1
                    last = (w.t, sign)
                before = now
        return flaps
