"""``pdserve up --autoscale``: the SLA planner (services/control/planner) run live against this stack.

Every ``--autoscale-interval`` seconds the launcher's main thread (its supervision loop, which
sleeps between polls: nothing here waits on its own) scrapes the gateway's /metrics, builds the
window since the previous scrape (autoscale_window.py), asks ``Planner.step`` for the counts,
prints the reasons, and acts:

- **up**: the launcher starts a worker of the role through its own start path (ports, NATS node,
  environment), on the CPUs (or GPUs) held by the fewest live workers. Forked from the main
  thread, so it too dies with ``pdserve up`` (PR_SET_PDEATHSIG);
- **down**: only by drain. The worker ``pick_to_drain`` names gets SIGTERM, exactly what
  Kubernetes sends: it takes no new requests, finishes its streams (or they migrate), serves the
  KV pulls it leased, and exits (services/worker_base.py). From that moment it is no capacity:
  the planner's counts and window leave it out, while its CPUs stay taken until it exits. It
  is then reaped and forgotten, and supervision never reports it as a crash.

The warm pool (services/control/warm_pool.py) is in the loop: **up** promotes a registered
standby worker first (SIGUSR1), and each decision sizes the pool (``Decision.pool``): what the
forecast needs by the time a cold start could serve, beyond what serves now, and at least
``--warm-prefill/decode-workers`` (the floor). Missing pooled workers start cold, on standby;
surplus loaded ones are stopped (SIGTERM: a standby worker holds nothing). Pooled workers are
no capacity, but cost budget; serving comes first.

The window tells the planner what only the launcher knows: the pool (all, and those registered),
the workers still loading (never drained), and the measured cold start: from a worker's launch
to its first appearance in the gateway's registry (to within an interval, as it is seen by a
scrape). A promotion's latency is not measured (the worker announces itself at once:
``PlannerConfig.warm_start_s``).

A worker that dies on its own is no capacity either: the next window counts without it, so the
planner replaces it if the load (or the minimum) needs it.

The budget is in the unit the stack runs on: GPUs (a worker costs one per TP rank) or CPUs (a
worker costs its CPU share: the CPUs per rank ``pdserve up`` gave the starting fleet, times its
ranks). By default it is what this host has, so on a small machine the minimum fleet may
already spend it; ``--autoscale-max-cpus`` above the host's count lets workers share CPUs.

``pdserve_planner_desired_workers{role}`` (and the current, draining and fractional need) are
served on ``--planner-metrics-port`` so an HPA or KEDA can act on the same decision.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.services.control.autoscale_settings import (  # noqa: F401 (re-exported)
    Settings,
    fleet_limits,
    planner_options,
    settings,
)
from pdserve.services.control.autoscale_window import Snapshot, Worker, build_window, parse_snapshot
from pdserve.services.control.launch_checks import metrics_request
from pdserve.services.control.placement import Placement, least_held, place  # noqa: F401 (re-exported)
from pdserve.services.control.planner.decide import Decision, Planner
from pdserve.services.control.planner.guards import pick_to_drain
from pdserve.services.control.planner.inputs import (
    ROLES,
    Counts,
    MetricsWindow,
)
from pdserve.services.control.processes import Child, visible_gpus
from pdserve.services.control.warm_pool import WarmPool
from pdserve.services.standby import PROMOTE_SIGNAL
from pdserve.shared.config import EngineConfig, UpConfig, WorkerConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.telemetry.metrics import MetricsServer, start_metrics_server

KILL_AFTER_DRAIN = 30.0  # a drain overrunning its --drain-seconds by this much is killed


@dataclass(frozen=True)
class WorkerStart:
    role: str
    place: Placement
    at: float  # time.monotonic() when the launcher started it


class Fleet(Protocol):
    """What the autoscaler needs of the launcher (services/launcher.Launcher)."""

    up: UpConfig
    engine: EngineConfig
    worker: WorkerConfig
    tps: dict[str, int]
    gpus: list[str]
    cpu_shares: list[list[int]] | None
    common: dict[str, object]
    children: list[Child]
    started: dict[str, WorkerStart]
    metrics_key: str | None  # the key the gateway's /metrics takes (--metrics-api-key), if any

    def add_worker(self, role: str, place: Placement, standby: bool = False) -> Child: ...


def say(text: str) -> None:
    print(f"pdserve autoscale: {text}", file=sys.stderr, flush=True)


class Autoscaler:
    def __init__(self, fleet: Fleet, config: Settings, host: str) -> None:
        """Made before the workers start (the budget is checked, the metrics port bound);
        ``begin`` starts the windows once the stack is ready."""
        self.fleet, self.config, self.url = fleet, config, ""
        cpus = sorted(os.sched_getaffinity(0))
        ranks = sum(fleet.tps[r] * getattr(fleet.up, f"{r}_workers") for r in ROLES)
        gpu = bool(fleet.gpus) or fleet.engine.device.startswith("cuda")
        if fleet.up.autoscale_max_gpus and not gpu:
            raise StartupError("--autoscale-max-gpus: this stack runs on the CPU")
        if gpu and not fleet.up.autoscale_max_cpus:
            self.unit, costs = "GPU", {r: float(fleet.tps[r]) for r in ROLES}
            here = len(fleet.gpus or visible_gpus())  # --device cuda: pdserve up places none
            budget = float(fleet.up.autoscale_max_gpus or max(1, here))
        else:
            # a rank's CPU share: what pdserve up gave the starting fleet's ranks
            per_rank = fleet.engine.torch_threads if fleet.cpu_shares is None else 0
            per_rank = int(per_rank or fleet.common.get("torch_threads") or len(cpus) // ranks)
            per_rank = max(1, per_rank)
            self.unit, costs = "CPU", {r: float(per_rank * fleet.tps[r]) for r in ROLES}
            budget = float(fleet.up.autoscale_max_cpus or len(cpus))
            if budget > len(cpus):
                say(f"budget {budget:g} CPUs > the {len(cpus)} here: workers will share CPUs")
        self.cpus = cpus if fleet.cpu_shares is not None else None
        self.costs = costs
        self.pool = WarmPool.from_flags(fleet.up)  # wanted: the floor, until the planner sizes it
        floor = Counts(self.pool.wanted["prefill"], self.pool.wanted["decode"])
        limits = fleet_limits(fleet.up, costs, budget, self.unit)
        least = Counts(limits.min_prefill, limits.min_decode)
        if limits.cost(least) + self.pool.cost(costs) > budget + 1e-9:
            raise StartupError(
                f"--autoscale: the minimum fleet and the warm pool's floor cost"
                f" {limits.cost(least) + self.pool.cost(costs):g} {self.unit} > budget"
                f" {budget:g}; --autoscale-max-{self.unit.lower()}s raises it (workers then share)"
            )
        planner_config = planner_options(config, floor, self.unit, budget, len(cpus))
        self.planner = Planner(
            profile=config.profile, slo=config.slo, limits=limits, config=planner_config
        )
        self.cold_starts: list[float] = []  # measured: launch -> first seen in the registry
        self.retiring: dict[str, tuple[Child, float]] = {}  # draining: child, kill deadline
        self.last: Decision | None = None
        # when each worker first showed in the gateway's registry: its age counts from there,
        # so one still loading is young (warm-up) and never drained mid-load
        self.joined: dict[str, float] = {}
        self.promote_on_join: set[str] = set()  # taken from the pool while loading
        self.registry = CollectorRegistry()
        gauge = lambda name, doc: Gauge(name, doc, ["role"], registry=self.registry)  # noqa: E731
        self.desired = gauge("pdserve_planner_desired_workers", "Workers the planner wants.")
        self.current = gauge("pdserve_planner_current_workers", "Workers serving (not draining).")
        self.draining = gauge("pdserve_planner_draining_workers", "Workers draining to exit.")
        self.need = gauge("pdserve_planner_need_workers", "The load in workers (fractional).")
        self.warm = gauge("pdserve_planner_warm_workers", "Standby workers in the warm pool.")
        self.actions = Counter(
            "pdserve_planner_scaling_actions",
            "Workers started (up) or drained (down).",
            ["role", "direction"],
            registry=self.registry,
        )
        self.server: MetricsServer | None = None
        if config.metrics_port:
            self.server = start_metrics_server(config.metrics_port, self.registry, host)
        self.before: Snapshot | None = None
        self.before_at = self.next_at = 0.0
        say(
            f"every {config.interval_s:g} s, {config.slo.describe()}, limits prefill"
            f" [{limits.min_prefill}, {limits.max_prefill}] decode [{limits.min_decode},"
            f" {limits.max_decode}], budget {budget:g} {self.unit} (a prefill worker costs"
            f" {costs['prefill']:g}, a decode worker {costs['decode']:g}), profile"
            f" {Path(str(fleet.up.planner_profile)).name}"
        )

    def begin(self, gateway_url: str) -> None:
        """The stack is ready: the first window starts now."""
        self.url = gateway_url
        self._export(self.counts())
        self.before = self.scrape()
        self.before_at = time.monotonic()
        self.next_at = self.before_at + self.config.interval_s

    # ---- what runs --------------------------------------------------------------------------

    def _alive(self) -> dict[str, Child]:
        return {
            c.name: c for c in self.fleet.children if c.name in self.fleet.started and c.alive()
        }

    def serving(self) -> dict[str, Worker]:
        """The workers that count as capacity: alive and not draining, with their ages since
        they registered (0, and loading, until then)."""
        now = time.monotonic()
        started = self.fleet.started
        return {
            name: Worker(
                started[name].role, now - self.joined.get(name, now), name not in self.joined
            )
            for name in self._alive()
            if name not in self.retiring and name not in self.pool
        }

    def pooled(self) -> tuple[Counts, Counts]:
        """The warm pool per role: every member, and those registered (ready to promote)."""
        alive = self._alive()
        every = [len([w for w in self.pool.of(r) if w in alive]) for r in ROLES]
        ready = [
            len([w for w in self.pool.of(r) if w in alive and w in self.joined]) for r in ROLES
        ]
        return Counts(*every), Counts(*ready)

    def counts(self) -> Counts:
        roles = [w.role for w in self.serving().values()]
        return Counts(roles.count("prefill"), roles.count("decode"))

    def retired(self, child: Child) -> bool:
        """Whether this child was stopped by the autoscaler (its exit is no crash)."""
        return child.name in self.retiring and self.retiring[child.name][0] is child

    def scrape(self) -> Snapshot | None:
        try:
            request = metrics_request(self.url, self.fleet.metrics_key)
            with urllib.request.urlopen(request, timeout=2.0) as resp:
                return parse_snapshot(resp.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            say(f"cannot read the gateway's metrics ({exc}): no decision this window")
            return None

    # ---- the loop ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Called by the launcher's supervision loop: reap finished drains, refill the warm
        pool; when an interval has passed, decide and act."""
        self._reap()
        self.refill()
        now = time.monotonic()
        if not self.url or now < self.next_at:
            return
        self.next_at = now + self.config.interval_s
        after = self.scrape()
        if after is None:
            return
        for name in after.workers:
            if name not in self.joined and name in self.fleet.started:
                self.cold_starts = [*self.cold_starts, now - self.fleet.started[name].at][-8:]
            self.joined.setdefault(name, now)
        self._promote_joined()
        if self.before is None:  # the gateway answered for the first time: a window starts
            self.before, self.before_at = after, now
            return
        window = build_window(
            self.before, after, now - self.before_at, self.config.slo.quantile, self.serving()
        )
        self.before, self.before_at = after, now
        self.step(self.with_fleet(window))

    def with_fleet(self, window: MetricsWindow) -> MetricsWindow:
        """The window with what only the launcher knows: the pool and the measured cold start."""
        pool, ready = self.pooled()
        cold = sum(self.cold_starts) / len(self.cold_starts) if self.cold_starts else None
        return dataclasses.replace(window, pool=pool, pool_ready=ready, cold_start_s=cold)

    def step(self, window: MetricsWindow) -> Decision:
        current = self.counts()
        decision = self.planner.step(window, current)
        if decision.counts != current:
            say(f"{current} -> {decision.counts}:\n  " + "\n  ".join(decision.reasons))
        elif self.last is None or decision.rules != self.last.rules:
            rules = ", ".join(decision.rules) or "none"
            say(
                f"hold {current} (need prefill {decision.need['prefill']:.2f}, decode"
                f" {decision.need['decode']:.2f}; rules: {rules})"
            )
        self.last = decision
        self.pool.resize(
            {r: decision.pool.of(r) for r in ROLES}
        )  # after this decision's promotions
        for role in ROLES:
            self.need.labels(role).set(decision.need[role])
            for _ in range(decision.counts.of(role) - current.of(role)):
                self._start(role)
            surplus = current.of(role) - decision.counts.of(role)
            for worker_id in pick_to_drain(window, role, surplus) if surplus > 0 else []:
                self._drain(worker_id)
        alive = self._alive()
        for worker_id in self.pool.surplus(lambda w: w in alive and w in self.joined):
            self._drain(worker_id, pooled=True)
        self.refill()
        self._export(decision.counts)
        return decision

    def _start(self, role: str) -> None:
        """One more serving worker: a registered one from the warm pool if there is one (SIGUSR1,
        services/standby.py); else one of the pool still loading, promoted once it registers
        (it serves sooner than a cold start would; a signal before then would find no handler);
        else a cold start. The pool is refilled after each decision."""
        alive = self._alive()
        worker_id = self.pool.take(role, lambda name: name in alive and name in self.joined)
        if worker_id is None:
            worker_id = self.pool.take(role, lambda name: name in alive)
            if worker_id is None:
                self._launch(role)
                return
            self.promote_on_join.add(worker_id)
            self.actions.labels(role, "up").inc()
            say(f"{worker_id} leaves the warm pool: promoted once it has loaded")
            return
        alive[worker_id].signal(PROMOTE_SIGNAL)
        self.actions.labels(role, "up").inc()
        say(f"promoted {worker_id} (pid {alive[worker_id].pid}) from the warm pool")

    def _promote_joined(self) -> None:
        """Promote the former pool members taken while loading that have now registered."""
        alive = self._alive()
        for worker_id in sorted(self.promote_on_join):
            if worker_id not in alive:
                self.promote_on_join.discard(worker_id)
            elif worker_id in self.joined:
                self.promote_on_join.discard(worker_id)
                alive[worker_id].signal(PROMOTE_SIGNAL)
                say(f"promoted {worker_id} (pid {alive[worker_id].pid}): it has loaded")

    def refill(self) -> None:
        """Start a standby worker for each one the warm pool lacks (one that died is gone)."""
        self.pool.forget_gone(self._alive())
        for role in self.pool.missing():
            self.pool.add(self._launch(role, standby=True).name, role)
        self.warm.labels("prefill").set(len(self.pool.of("prefill")))
        self.warm.labels("decode").set(len(self.pool.of("decode")))

    def _launch(self, role: str, standby: bool = False) -> Child:
        held = [self.fleet.started[name].place for name in self._alive()]
        cpu_cost = int(self.costs[role])
        where = place(held, self.cpus, cpu_cost, self.fleet.gpus, self.fleet.tps[role])
        if standby:
            child = self.fleet.add_worker(role, where, standby=True)
        else:
            child = self.fleet.add_worker(role, where)
            self.actions.labels(role, "up").inc()
        text = f" on CPUs {','.join(map(str, where.cpus))}" if where.cpus else ""
        text += f" on GPU {where.gpu}" if where.gpu else ""
        say(f"started {child.name} (pid {child.pid}){text}" + (" for the warm pool" * standby))
        return child

    def _drain(self, worker_id: str, pooled: bool = False) -> None:
        """SIGTERM, as Kubernetes sends: a serving worker drains; a pooled one (standby, holding
        nothing) leaves the pool and exits. Either is no crash when it exits."""
        child = self._alive().get(worker_id)
        if child is None:
            return
        deadline = time.monotonic() + self.fleet.worker.drain_seconds + KILL_AFTER_DRAIN
        self.retiring[worker_id] = (child, deadline)
        child.signal(signal.SIGTERM)
        if pooled:
            self.pool.remove(worker_id)
            say(f"stopping {worker_id} (pid {child.pid}): the warm pool shrinks")
            return
        self.actions.labels(self.fleet.started[worker_id].role, "down").inc()
        say(f"draining {worker_id} (pid {child.pid}): SIGTERM, no new requests, in-flight finish")

    def _reap(self) -> None:
        reaped = False
        for worker_id, (child, deadline) in list(self.retiring.items()):
            if child.alive():
                if time.monotonic() > deadline:
                    say(f"{worker_id} is still draining past its deadline: killed")
                    child.signal(signal.SIGKILL)
                continue
            code = child.stop(0.0)  # reaps it and whatever its process group left
            del self.retiring[worker_id]
            self.fleet.started.pop(worker_id, None)
            if child in self.fleet.children:
                self.fleet.children.remove(child)
            say(f"{worker_id} drained and exited ({code})")
            reaped = True
        if reaped:
            self._export(self.last.counts if self.last is not None else self.counts())

    def _export(self, desired: Counts) -> None:
        current = self.counts()
        roles = [self.fleet.started[n].role for n in self.retiring if n in self.fleet.started]
        for role in ROLES:
            self.desired.labels(role).set(desired.of(role))
            self.current.labels(role).set(current.of(role))
            self.draining.labels(role).set(roles.count(role))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
