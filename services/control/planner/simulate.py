"""A simulated serving fleet driven by a ``Profile`` (no model): fast tests of the planner, and the
same load ramp at a GPU host's scale.

Requests arrive by a ``RateSchedule`` (a Poisson process whose rate follows a piecewise-linear
curve, drawn by thinning), or replay a recorded trace of arrival times, with lengths from a
``Workload``. The gateway routes each prompt to the prefill worker with the least queued work, then
(after ``kv_transfer_ms``) its sequence to the decode worker with the least KV reserved or waiting;
sim_workers.py says how each worker spends its time. Every ``window_s`` the simulator builds the
``MetricsWindow`` the planner reads (rate, mean ISL/OSL, TTFT and ITL at the SLO's percentile, each
serving worker's age, KV usage and queue; the workers still loading; the warm pool; the start
latencies measured), calls the planner, and applies its decision (sim_fleet.py): a new worker
serves ``startup_s`` after it is asked for, or ``promote_s`` after it is promoted from the warm
pool, and costs from its start, pooled or serving; a removed worker is drained (no new work, it
finishes what it holds, then goes). The budget holds for the fleet as it physically is, the pool
included.

Deterministic for a seed; a 10-minute ramp of a few thousand requests runs in well under a second.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable

from pdserve.services.control.planner.decide import Decision
from pdserve.services.control.planner.inputs import Counts, Limits, MetricsWindow, WorkerSample
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import (
    RateSchedule,
    SimConfig,
    SimResult,
    WindowRecord,
)
from pdserve.services.control.planner.sim_fleet import SimFleet
from pdserve.services.control.planner.sim_workers import (
    ACTIVE,
    DRAINING,
    STARTING,
    DecodeWorker,
    Gaps,
    PrefillWorker,
    SimRequest,
    Worker,
)
from pdserve.services.control.planner.workload import SLO, Workload

ARRIVE, PREFILL_DONE, KV_READY, DECODE, READY, TICK = range(6)


class _Sim:
    def __init__(
        self,
        profile: Profile,
        workload: Workload,
        schedule: RateSchedule,
        slo: SLO,
        planner: Callable[[MetricsWindow, Counts], Decision] | None,
        limits: Limits | None,
        config: SimConfig,
    ) -> None:
        self.profile, self.workload, self.schedule, self.slo = profile, workload, schedule, slo
        self.planner, self.limits, self.cfg = planner, limits, config
        self.rng = random.Random(config.seed)
        self.replayed = 0  # how many of config.arrivals have been scheduled
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.now = 0.0
        self.gaps = Gaps()
        self.fleet = SimFleet(
            profile,
            limits,
            config,
            self.gaps,
            on_ready=lambda w: self.push(w.ready_at, READY, w),
            on_first_token=self.first_token,
        )
        self.unrouted: dict[str, deque[SimRequest]] = {"prefill": deque(), "decode": deque()}
        self.requests: list[SimRequest] = []
        self.win_ttft: list[float] = []
        self.win_arrivals = [0, 0, 0]  # count, ISL sum, OSL sum
        self.windows: list[WindowRecord] = []
        self.decisions: list[Decision] = []

    # ---- plumbing ----------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: object = None, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload, version))

    def serving(self, role: str) -> list[Worker]:
        return self.fleet.serving(role)

    # ---- requests ----------------------------------------------------------------------------

    def first_token(self, req: SimRequest) -> None:
        self.win_ttft.append(req.ttft_ms)

    def route_prefill(self, req: SimRequest) -> None:
        role = "aggregated" if self.cfg.aggregated else "prefill"
        pool = self.serving(role)
        if not pool:
            self.unrouted["prefill"].append(req)
            return
        if role == "aggregated":
            self.route_decode(req)
            return
        w = min(pool, key=lambda w: w.backlog_tokens)
        due = w.add(req, self.now)
        if due is not None:
            self.push(due, PREFILL_DONE, w)

    def route_decode(self, req: SimRequest) -> None:
        pool = self.serving("aggregated" if self.cfg.aggregated else "decode")
        if not pool:
            self.unrouted["decode"].append(req)
            return
        w = min(pool, key=lambda w: w.load_tokens())
        self.schedule_decode(w, w.add(req, self.now))

    def schedule_decode(self, w: DecodeWorker, due: float | None) -> None:
        if due is not None:
            self.push(due, DECODE, w, w.version)
        elif w.state == DRAINING and w.idle():
            self.fleet.retire(w)

    # ---- windows and decisions ---------------------------------------------------------------

    def window(self) -> MetricsWindow:
        n, isl, osl = self.win_arrivals
        samples = []
        for w in self.fleet.workers:
            role = "decode" if w.role == "aggregated" else w.role
            if w.state == ACTIVE:
                kv, queue, running = w.load()
                samples.append(
                    WorkerSample(
                        worker_id=w.worker_id,
                        role=role,
                        age_s=w.age(self.now),
                        kv_usage=kv,
                        queue=queue,
                        running=running,
                    )
                )
            elif w.state == STARTING and not w.pooled:  # capacity coming: never drained
                samples.append(
                    WorkerSample(worker_id=w.worker_id, role=role, age_s=0.0, loading=True)
                )
        ttft = sorted(self.win_ttft)
        q = self.slo.quantile
        pool, ready = self.fleet.pool()
        cold, warm = self.fleet.cold_starts, self.fleet.warm_starts
        return MetricsWindow(
            duration_s=self.cfg.window_s,
            requests=n,
            mean_isl=isl / n if n else 0.0,
            mean_osl=osl / n if n else 0.0,
            ttft_ms=ttft[min(len(ttft) - 1, math.ceil(q * len(ttft)) - 1)] if ttft else None,
            itl_ms=self.gaps.percentile(q),
            workers=tuple(samples),
            pool=pool,
            pool_ready=ready,
            cold_start_s=sum(cold) / len(cold) if cold else None,
            warm_start_s=sum(warm) / len(warm) if warm else None,
        )

    def tick(self) -> None:
        window = self.window()
        decision = None
        if self.planner is not None:
            decision = self.planner(window, self.fleet.counted())
            self.decisions.append(decision)
            self.fleet.apply(decision.counts, decision.pool)
        serving = Counts(
            len(self.serving("prefill")),
            len(self.serving("decode")) + len(self.serving("aggregated")),
        )
        self.windows.append(
            WindowRecord(
                t=self.now,
                request_rate=window.request_rate,
                ttft_ms=window.ttft_ms,
                itl_ms=window.itl_ms,
                serving=serving,
                live_cost=self.fleet.live_cost(),
                desired=decision.counts if decision else None,
                rules=decision.rules if decision else (),
                pool=self.fleet.pool()[0],
                forecast=decision.ahead.rate if decision and decision.ahead else None,
            )
        )
        self.gaps.samples.clear()
        self.win_ttft.clear()
        self.win_arrivals = [0, 0, 0]

    # ---- the loop ----------------------------------------------------------------------------

    def next_arrival(self, t: float) -> None:
        if self.cfg.arrivals:
            if self.replayed < len(self.cfg.arrivals):
                self.push(self.cfg.arrivals[self.replayed], ARRIVE)
                self.replayed += 1
            return
        peak = self.schedule.peak
        if peak <= 0:
            return
        while True:  # thinning: candidates at the peak rate, kept with probability rate/peak
            t += self.rng.expovariate(peak)
            if t >= self.schedule.duration:
                return
            if self.rng.random() * peak < self.schedule.rate(t):
                self.push(t, ARRIVE)
                return

    def run(self) -> SimResult:
        cfg = self.cfg
        roles = [("aggregated", cfg.aggregated)] if cfg.aggregated else []
        roles += [("prefill", cfg.prefill), ("decode", cfg.decode)]
        for role, n in roles:
            for _ in range(n):
                self.fleet.start(role)
        for role in ("prefill", "decode"):  # the warm pool's floor, loaded with the fleet
            for _ in range(cfg.pool.of(role)):
                self.fleet.start(role, pooled=True)
        self.next_arrival(0.0)
        t = cfg.window_s
        while t <= self.schedule.duration + 1e-9:
            self.push(t, TICK)
            t += cfg.window_s
        end = self.schedule.duration + cfg.tail_s
        while self.events and self.events[0][0] <= end:
            self.now, _, kind, payload, version = heapq.heappop(self.events)
            self.fleet.now = self.now
            self.handle(kind, payload, version)
        return self.result()

    def handle(self, kind: int, payload: object, version: int) -> None:
        if kind == ARRIVE:
            isl, osl = self.workload.lengths(self.rng)
            req = SimRequest(index=len(self.requests), arrival=self.now, isl=isl, osl=osl)
            self.requests.append(req)
            self.win_arrivals[0] += 1
            self.win_arrivals[1] += isl
            self.win_arrivals[2] += osl
            self.route_prefill(req)
            self.next_arrival(self.now)
        elif kind == PREFILL_DONE:
            w = payload
            assert isinstance(w, PrefillWorker)
            done, due = w.finish(self.now)
            for req in done:
                self.first_token(req)
                self.push(self.now + self.cfg.kv_transfer_ms / 1000.0, KV_READY, req)
            if due is not None:
                self.push(due, PREFILL_DONE, w)
            elif w.state == DRAINING and w.idle():
                self.fleet.retire(w)
        elif kind == KV_READY:
            assert isinstance(payload, SimRequest)
            self.route_decode(payload)
        elif kind == DECODE:
            w = payload
            assert isinstance(w, DecodeWorker)
            if version == w.version:
                w.settle(self.now)
                self.schedule_decode(w, w.replan())
        elif kind == READY:
            w = payload
            assert isinstance(w, Worker)
            if self.fleet.loaded(w):
                for which in ("prefill", "decode"):
                    waiting, self.unrouted[which] = self.unrouted[which], deque()
                    for req in waiting:
                        (self.route_prefill if which == "prefill" else self.route_decode)(req)
        elif kind == TICK:
            self.tick()

    def result(self) -> SimResult:
        d = self.schedule.duration
        seconds, pooled = self.fleet.worker_seconds(d)
        return SimResult(
            requests=self.requests,
            windows=self.windows,
            decisions=self.decisions,
            worker_seconds=seconds,
            scale_actions=self.fleet.actions,
            max_cost=self.fleet.max_cost,
            duration_s=d,
            pool_seconds=pooled,
            pool_actions=self.fleet.pool_actions,
        )


def simulate(
    profile: Profile,
    workload: Workload,
    schedule: RateSchedule,
    slo: SLO,
    *,
    planner: Callable[[MetricsWindow, Counts], Decision] | None = None,
    limits: Limits | None = None,
    config: SimConfig = SimConfig(),
) -> SimResult:
    """Run the schedule through the fleet; ``planner`` (e.g. ``Planner(...).step``) resizes it
    every window, without one the fleet stays as ``config`` starts it. The workload's rate is not
    used: the schedule's is."""
    if config.aggregated and (config.prefill or config.decode):
        raise ValueError("an aggregated fleet has no separate prefill or decode workers")
    return _Sim(profile, workload, schedule, slo, planner, limits, config).run()
