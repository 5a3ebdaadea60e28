"""The simulated fleet's bookkeeping: which workers exist and in what state, and how a planner's
``Decision`` changes them (simulate.py runs the requests and the clock).

- **up**: a serving worker more is a pooled one promoted (a loaded one first: it serves after
  ``promote_s``; else one still loading, which then serves once loaded), or else a cold start
  that serves ``startup_s`` after it is asked for;
- **down**: one not started yet (waiting for budget) is forgotten, one loading stops at once, and
  otherwise the least loaded serving worker drains (no new work; it finishes what it holds);
- **pool**: the pool is then brought to the decision's size: cold starts on standby, or pooled
  workers stopped (not started yet first, then loaded ones, then loading ones).

Every worker costs from its start to its exit, pooled or not, and the budget holds for the fleet
as it physically is: a worker asked for while draining ones still hold the budget waits until
they are gone. The start latencies are measured as they happen (a start's wait for budget
included) for the planner's window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pdserve.services.control.planner.inputs import ROLES, Counts, Limits
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import SimConfig
from pdserve.services.control.planner.sim_workers import (
    ACTIVE,
    DRAINING,
    GONE,
    POOLED,
    STARTING,
    DecodeWorker,
    Gaps,
    PrefillWorker,
    SimRequest,
    Worker,
)


class SimFleet:
    def __init__(
        self,
        profile: Profile,
        limits: Limits | None,
        config: SimConfig,
        gaps: Gaps,
        on_ready: Callable[[Worker], None],
        on_first_token: Callable[[SimRequest], None],
    ) -> None:
        self.profile, self.limits, self.cfg, self.gaps = profile, limits, config, gaps
        self.on_ready, self.on_first_token = on_ready, on_first_token  # on_ready: at ready_at
        self.workers: list[Worker] = []
        self.pending: deque[tuple[str, bool, float]] = deque()  # (role, pooled, asked at)
        self.now = 0.0
        self.names = 0
        self.max_cost = 0.0
        self.actions = 0  # serving count changes asked for, per role and decision
        self.pool_actions = 0  # pool size changes, per role and decision
        self.cold_starts: list[float] = []  # measured: asked for -> loaded
        self.warm_starts: list[float] = []  # measured: promoted -> serving

    # ---- what there is -------------------------------------------------------------------------

    def cost_of(self, role: str) -> float:
        if self.limits is None:
            return 1.0
        return self.limits.cost_of("decode" if role == "aggregated" else role)

    def live_cost(self) -> float:
        return sum(self.cost_of(w.role) for w in self.workers if w.state != GONE)

    def serving(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.state == ACTIVE]

    def pooled(self, role: str) -> list[Worker]:
        """Pooled workers of a role, loaded ones first, then by when they will be."""
        pool = [w for w in self.workers if w.role == role and w.pooled and w.state != GONE]
        return sorted(pool, key=lambda w: (w.state != POOLED, w.ready_at))

    def counted(self) -> Counts:
        """The planner's counts: serving and loading to serve, and starts waiting for budget."""

        def n(role: str) -> int:
            live = sum(
                1
                for w in self.workers
                if w.role == role and not w.pooled and w.state in (STARTING, ACTIVE)
            )
            return live + sum(1 for r, pooled, _ in self.pending if r == role and not pooled)

        return Counts(n("prefill"), n("decode"))

    def pool(self) -> tuple[Counts, Counts]:
        """Pooled workers per role (waiting for budget and loading included), and loaded ones."""
        total = [
            len(self.pooled(r)) + sum(1 for q, pooled, _ in self.pending if q == r and pooled)
            for r in ROLES
        ]
        ready = [sum(1 for w in self.pooled(r) if w.state == POOLED) for r in ROLES]
        return Counts(*total), Counts(*ready)

    # ---- starting and stopping -----------------------------------------------------------------

    def start(self, role: str, pooled: bool = False, asked: float | None = None) -> None:
        """Start one, or queue it while the budget is held (by draining workers, say)."""
        asked = self.now if asked is None else asked
        budget = self.limits.budget if self.limits else None
        if self.pending or (
            budget is not None and self.live_cost() + self.cost_of(role) > budget + 1e-9
        ):
            self.pending.append((role, pooled, asked))
            return
        self.names += 1
        name = f"{role}-{self.names}"
        ready_at = self.now + self.cfg.startup_s if self.now > 0 else 0.0  # t = 0: loaded
        if role == "prefill":
            w: Worker = PrefillWorker(
                worker_id=name,
                created=self.now,
                ready_at=ready_at,
                profile=self.profile,
                deadline_s=self.cfg.prompt_deadline_s,
            )
        else:
            chunk = self.cfg.chunk_tokens if role == "aggregated" else 0
            w = DecodeWorker(
                worker_id=name,
                created=self.now,
                ready_at=ready_at,
                profile=self.profile,
                gaps=self.gaps,
                chunk_tokens=chunk,
            )
            w.on_first_token = self.on_first_token
            w.t_sync = ready_at
        w.pooled = pooled
        w.asked = asked
        self.workers.append(w)
        self.max_cost = max(self.max_cost, self.live_cost())
        self.on_ready(w)

    def loaded(self, w: Worker) -> bool:
        """``w`` reached its ready time: True when it now serves (False: pooled, or gone)."""
        if w.state != STARTING:
            return False
        if w.created > 0:
            self.cold_starts.append(w.ready_at - w.asked)
        if w.pooled:
            w.state = POOLED
            return False
        if w.promoted == w.promoted and w.promoted >= w.created:
            self.warm_starts.append(self.now - w.promoted)
        w.state = ACTIVE
        return True

    def promote(self, w: Worker) -> None:
        """A pooled worker goes to serve: a loaded one after ``promote_s``, one loading once
        loaded."""
        w.pooled, w.promoted = False, self.now
        if w.state == POOLED:
            w.state, w.ready_at = STARTING, self.now + self.cfg.promote_s
            self.on_ready(w)

    def retire(self, w: Worker) -> None:
        w.state, w.retired = GONE, self.now
        waiting, self.pending = self.pending, deque()
        for role, pooled, asked in waiting:  # in order: each starts if it fits, else waits again
            self.start(role, pooled, asked)

    def remove_one(self, role: str) -> None:
        for i, (r, pooled, _) in enumerate(self.pending):
            if r == role and not pooled:
                del self.pending[i]
                return
        starting = [
            w for w in self.workers if w.role == role and not w.pooled and w.state == STARTING
        ]
        if starting:  # never served: it goes at once
            self.retire(starting[-1])
            return
        active = self.serving(role)
        w = min(active, key=lambda w: (sum(w.load()[1:]), w.load()[0], w.worker_id))
        w.state = DRAINING
        if w.idle():
            self.retire(w)

    def stop_pooled(self, role: str) -> None:
        for i, (r, pooled, _) in enumerate(self.pending):
            if r == role and pooled:
                del self.pending[i]
                return
        self.retire(self.pooled(role)[0])

    # ---- a decision ----------------------------------------------------------------------------

    def apply(self, desired: Counts, pool: Counts) -> None:
        current = self.counted()
        for role in ROLES:
            diff = desired.of(role) - current.of(role)
            self.actions += diff != 0
            for _ in range(max(0, diff)):
                pooled = self.pooled(role)
                if pooled:
                    self.promote(pooled[0])
                else:
                    self.start(role)
            for _ in range(max(0, -diff)):
                self.remove_one(role)
        have = self.pool()[0]
        for role in ROLES:
            diff = pool.of(role) - have.of(role)
            self.pool_actions += diff != 0
            for _ in range(max(0, diff)):
                self.start(role, pooled=True)
            for _ in range(max(0, -diff)):
                self.stop_pooled(role)

    def worker_seconds(self, duration: float) -> tuple[dict[str, float], float]:
        """GPU (or worker) seconds within ``duration`` per role, pooled time included, and the
        pooled time alone."""
        seconds: dict[str, float] = {}
        pooled = 0.0
        for w in self.workers:
            until = min(w.retired if w.retired == w.retired else duration, duration)
            seconds[w.role] = seconds.get(w.role, 0.0) + max(0.0, until - w.created)
            if w.promoted == w.promoted or w.pooled:
                left_pool = w.promoted if w.promoted == w.promoted else until
                pooled += max(0.0, min(left_pool, until) - w.created)
        return seconds, pooled
