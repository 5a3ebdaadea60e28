"""One planner decision: a pure function of a metrics window, the profile, the SLOs, the limits,
the current worker counts and the planner's own state (no clock, no globals; the new state comes
back in the ``Decision``). It says how many workers of each role serve (or load to serve) and
how many wait loaded in the warm pool.

The arithmetic is sizing.py's, on the load demand.py forecasts. Around it stand named rules, each
against a failure seen in the field (NVIDIA Dynamo's planner issues) or a practice of llm-d's
variant autoscaler or Kubernetes' HPA:

- ``warm-up`` (dy#12430, cold-start samples inflate the counts): latency samples are not used to
  update a role's correction while any worker of that role is loading or younger than
  ``warmup_s`` (its first requests pay compilation and cache warm-up), and a role with such a
  worker is not scaled down (it has not taken its share of the load yet; one still loading is
  never drained: SIGTERM would kill it before it can drain);
- ``few-requests``: a window with fewer than ``min_requests`` requests leaves both corrections as
  they were (a percentile of a handful of samples is noise). Its rate still counts: zero is a rate;
- ``unsteady``: nor does a window whose rate moved more than ``steady_band`` from the forecast's
  level: its latencies span the move while the batch they are read against is its end's;
- ``idle-window``: a window without arrivals while requests still run or wait (a stalled client,
  a lost scrape) changes nothing, the forecasters included: a rate of 0 fed to them would be
  followed by a rebound read as a surge;
- ``zero-demand`` (dy#11624, dy#14251, never scaled down at zero demand): a window without
  requests, with nothing running, has no TTFT or ITL, and that must not stall the planner: the
  need is zero and the counts go to the minimum, subject to the same hysteresis as any
  scale-down;
- ``forecast``: a worker asked for now serves only after its start, so each window's rate, ISL
  and OSL feed Holt filters (forecast.py) and the load is looked ahead to when a worker asked
  for now would serve, and until the next decision's could (demand.py), never below its present
  level. Serving is sized for a promotion from the warm pool (it serves at once); what a cold
  start's horizon needs beyond it waits in the pool (``use_pool=False``: serving is sized for the
  cold horizon). All the workers the forecast needs come in one action (sized steps);
- ``backlog``: requests queued at a role's workers are demand too: the rate a role is sized for
  is the arrival rate plus its queue spread over one window, so a backlog built while workers
  started is cleared rather than carried;
- ``pool``: the warm pool holds what the cold horizon's outlook, raised by ``pool_z`` of the
  forecast's measured error, needs beyond the serving target, and at least ``pool_floor``
  (``--warm-*-workers``) of capacity available at once (serving capacity beyond the need, now
  or at the cold horizon, counts, fractionally and within the dead band of the serving fleet:
  a noisy window's need 0.05 above a worker does not start one), within what serving leaves of
  the budget. It shrinks only after ``scale_down_windows`` windows in a row asked for less
  (serving's hysteresis), and not within the role's cooldown after it grew; it does not grow
  while its role is on the way down (that would start one worker to stop another);
- ``dead-band`` (hysteresis): a role scales up as soon as ceil(need) exceeds its count, but down to
  n only when the need fits n workers with a margin, need <= n x (1 - dead_band); a load sitting
  exactly at a threshold therefore moves the count once and then holds it;
- ``falling``: but a load forecast to fall by more than the dead band before a worker removed now
  could be back (a cold start and a window) is not sitting at a threshold: the fall is the
  margin, and the way down takes no dead band and no streak (the fall's trend, fitted over
  many windows, is the evidence a streak collects; the survivors' check, the one step and the
  warm pool's floor still stand between a noisy window and a drain);
- ``cooldown`` (HPA's scale-down stabilization, learnt): a scale-up within ``flap_starts``
  replacement times (a cold start and a window) of the role's last scale-down undid it: a flap.
  Each flap sets the role's cooldown to at least twice the last one and the cycle just seen, and
  the role is not scaled down (nor its pool shrunk) until the load has not needed all its workers
  for that long. A sawtooth load is held at its peak's fleet after a flap or two; a ramp that
  never turns back pays nothing. The cooldown halves every ``cooldown_half_life_s``;
- ``scale-down-streak`` (hysteresis): a scale-down happens only after ``scale_down_windows``
  consecutive windows all asked for one (one while the load is ``falling``);
- ``one-step``: a scale-down removes at most ``down_step`` serving workers of a role (the rest
  wait for the next streak): the way down is taken one step at a time, each one checked against
  the load the survivors then carry;
- ``survivors`` (dy#9294, oscillation between 2 and 1 under constant load; llm-d simulates a
  scale-down first): before removing workers, the load they carry now (KV usage and queued
  requests, summed over the role) is spread over the survivors; if a survivor would be saturated
  (KV usage >= ``kv_saturation`` or queue >= ``queue_saturation``) fewer workers are removed;
- ``min-max``: each role stays within its limits;
- ``budget`` (dy#12428, exceeded the GPU budget): the fleet's cost (serving and pooled workers x
  cost per role) never exceeds the budget. When it binds, the split that serves the largest share
  of the sustained demand is kept (a prefill/decode pipeline serves only as much as its scarcer
  role allows; a backlog does not count), growth is trimmed rather than a role cut (unless the
  fleet is already over a lowered budget), the decision says which role got fewer workers than
  it needs, and why; the pool gives way first;
- ``cores``: where the budget oversubscribes a CPU host (``host_cpus``), busy workers split its
  cores, so a worker beyond them adds its role a share of a core and takes as much from every
  other one. Growth is trimmed to the counts that serve the largest share of the demand at
  that split, the smaller fleet on a tie (on 2 cores, 1P1D stays 1P1D); the pool keeps its floor
  and, above it, only what serving leaves of the cores (a pooled worker loads on them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.services.control.planner.corrections import corrections
from pdserve.services.control.planner.demand import (
    Outlook,
    Sizing,
    backlog,
    horizons,
    observe,
    outlook,
    size,
)
from pdserve.services.control.planner.guards import fit_budget, fit_cores, fit_pool
from pdserve.services.control.planner.inputs import (
    ROLES,
    Counts,
    Limits,
    MetricsWindow,
    PlannerConfig,
    PlannerState,
)
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.role_plan import (
    pool_target,
    remember,
    serving_target,
)
from pdserve.services.control.planner.rules import (
    BACKLOG,
    BUDGET,
    CORES,
    FALLING,
    FORECAST,
    IDLE_WINDOW,
    ZERO_DEMAND,
    Notes,
)
from pdserve.services.control.planner.workload import SLO


@dataclass(frozen=True)
class Decision:
    prefill: int  # serving workers wanted (loading ones count): the planner's counts
    decode: int
    reasons: tuple[str, ...]  # the arithmetic and every rule that acted, in order
    state: PlannerState
    need: dict[str, float]  # fractional workers per role: the arithmetic (forecast, backlog in)
    rules: tuple[str, ...]  # names of the rules that changed a count or discarded samples
    pool: Counts = Counts(0, 0)  # standby workers wanted in the warm pool, per role
    ahead: Outlook | None = None  # the load sized for when a cold start would serve

    @property
    def counts(self) -> Counts:
        return Counts(self.prefill, self.decode)


def _held(window: MetricsWindow, current: Counts, state: PlannerState, run: Notes) -> Decision:
    return Decision(
        prefill=current.prefill,
        decode=current.decode,
        reasons=tuple(run.reasons),
        state=state,
        need={r: float(current.of(r)) for r in ROLES},
        rules=tuple(dict.fromkeys(run.rules)),
        pool=window.pool,
    )


def _sizings(
    window: MetricsWindow,
    profile: Profile,
    slo: SLO,
    current: Counts,
    state: PlannerState,
    config: PlannerConfig,
    run: Notes,
) -> tuple[dict[str, Sizing], dict[str, int], dict[str, float], Outlook]:
    """Per role, the sizing of the serving target, the workers the upper outlook needs, and the
    sustained need the budget is split by (the cold horizon's, without the backlog: a queue
    built in an overload is cleared by whichever workers there are, and must not buy one role
    the budget the other will need for good)."""
    hz = horizons(window, config)
    cold, warm = outlook(state, hz.cold, config), outlook(state, hz.warm, config)
    upper = outlook(state, hz.cold, config, config.pool_z)
    r = state.rate
    run.note(
        FORECAST if r.trend > 0 else None,
        f"forecast: rate {r.level:.2f} req/s, trend {r.trend:+.2f} a window; after a cold start"
        f" ({hz.cold_s:g} s, {hz.cold:.1f} windows ahead) {cold.describe()}, up to"
        f" {upper.rate:.2f} req/s ({config.pool_z:g} std errors); from the pool"
        f" ({hz.warm_s:g} s) {warm.rate:.2f} req/s",
    )
    extra = backlog(window)
    for role in ROLES:
        if extra[role] > 0:
            run.note(
                BACKLOG,
                f"{role} backlog: {extra[role] * window.duration_s:.0f} queued -> +"
                f"{extra[role]:.2f} req/s to clear it within one window",
            )
    sizings: dict[str, Sizing] = {}
    uppers: dict[str, int] = {}
    split: dict[str, float] = {}
    for role in ROLES:
        at_cold = size(role, cold, extra[role], profile, slo, state, config)
        split[role] = size(role, cold, 0.0, profile, slo, state, config).need
        top = size(role, upper, extra[role], profile, slo, state, config).workers
        if config.use_pool:
            # serving for the pool's horizon: what the cold horizon needs beyond it waits in
            # the pool, loaded, and is promoted as the load arrives (or stopped if it does not)
            sizings[role] = size(role, warm, extra[role], profile, slo, state, config)
            uppers[role] = max(top, at_cold.workers)
        else:
            sizings[role], uppers[role] = at_cold, 0
        run.reasons.append(sizings[role].explain())
    return sizings, uppers, split, cold


def decide(
    window: MetricsWindow,
    profile: Profile,
    slo: SLO,
    limits: Limits,
    current: Counts,
    state: PlannerState,
    config: PlannerConfig = PlannerConfig(),
) -> Decision:
    run = Notes(
        reasons=[
            f"window {window.duration_s:g} s: {window.requests} requests ({window.request_rate:.2f}"
            f" req/s), ISL {window.mean_isl:.0f}, OSL {window.mean_osl:.0f}; TTFT"
            f" {_ms(window.ttft_ms)}, ITL {_ms(window.itl_ms)} at {slo.percentile}; now {current},"
            f" pool {window.pool} ({window.pool_ready} ready)"
        ],
        rules=[],
    )
    state = dataclasses.replace(
        state,
        **{r: state.of(r).aged(window.duration_s, config.cooldown_half_life_s) for r in ROLES},
    )
    state, lines, rules = corrections(window, profile, state, config)
    run.reasons += lines
    run.rules += rules
    busy = sum(w.running + w.queue for w in window.workers)
    if window.requests == 0 and busy:
        run.note(IDLE_WINDOW, f"no arrivals while {busy} requests run or wait: hold {current}")
        return _held(window, current, state, run)
    state = observe(window, state, config)
    if window.requests > 0 and state.isl.n == 0:
        # requests arrived but none has finished yet (the gateway counts tokens at the finish):
        # no sizes to plan with, so hold rather than size for 1-token requests
        run.note(None, f"{window.requests} arrived, none finished: no ISL/OSL yet, hold {current}")
        return _held(window, current, state, run)

    sizings: dict[str, Sizing | None] = {r: None for r in ROLES}
    uppers: dict[str, int | None] = {r: None for r in ROLES}
    split = {r: 0.0 for r in ROLES}
    ahead = None
    if window.requests == 0:
        run.note(ZERO_DEMAND, "no requests: the need is 0, the counts go to the minimum")
    else:
        found, top, sustained, ahead = _sizings(window, profile, slo, current, state, config, run)
        sizings.update(found)
        uppers.update(top)
        split.update(sustained)
    need = {r: s.need if s is not None else 0.0 for r, s in sizings.items()}

    wanted, streaks = current, {}
    falling = _falling(window, state, config)
    if falling:
        run.note(
            FALLING,
            f"falling: the rate is forecast at {state.rate.forecast(horizons(window, config).cold):.2f}"
            f" req/s a replacement time on, under {1 - config.dead_band:.0%} of its level"
            f" {state.rate.level:.2f}: no dead band on the way down",
        )
    for role in ROLES:
        target, streaks[role] = serving_target(
            role, sizings[role], window, limits, current, state.of(role), config, run, falling
        )
        wanted = wanted.with_(role, target)
    final, why = fit_budget(wanted, split, limits, current)
    if why:
        run.note(BUDGET, why)
    if config.host_cpus is not None:
        final, why = fit_cores(final, split, limits, current, config.host_cpus)
        if why:
            run.note(CORES, why)
    # the reserve must still be there when a pooled worker started now would be: the serving
    # workers' spare is counted against the need now and at the cold horizon
    pools = {
        r: pool_target(
            r,
            uppers[r],
            final.of(r),
            max(need[r], split[r]),
            window,
            current,
            state.of(r),
            config,
            run,
        )
        for r in ROLES
    }
    pool = Counts(*(pools[r][0] for r in ROLES))
    fitted = fit_pool(pool, config.pool_floor, final, limits)
    if fitted != pool:
        run.note(BUDGET, f"pool {pool} -> {fitted}: what serving leaves of the budget")
    if config.host_cpus is not None:
        # a pooled worker loads on the cores: beyond what serving leaves of them, only the floor
        cored = fit_pool(fitted, config.pool_floor, final, limits, config.host_cpus)
        cored = Counts(*(max(cored.of(r), config.pool_floor.of(r)) for r in ROLES))
        if cored != fitted:
            run.note(CORES, f"pool {fitted} -> {cored}: what serving leaves of the cores")
        fitted = cored
    memory = {}
    for role in ROLES:
        sizing = sizings[role]
        needed = sizing is not None and sizing.workers >= current.of(role)
        memory[role] = remember(
            role,
            state.of(role),
            streaks[role],
            needed,
            current,
            final,
            fitted,
            window,
            config,
            run,
        )
        memory[role] = dataclasses.replace(memory[role], pool_streak=pools[role][1])
        if final.of(role) != current.of(role):
            run.note(None, f"{role}: {current.of(role)} -> {final.of(role)}")
    return Decision(
        prefill=final.prefill,
        decode=final.decode,
        reasons=tuple(run.reasons),
        state=dataclasses.replace(state, **memory),
        need=need,
        rules=tuple(dict.fromkeys(run.rules)),
        pool=fitted,
        ahead=ahead,
    )


def _falling(window: MetricsWindow, state: PlannerState, config: PlannerConfig) -> bool:
    """Whether the rate is forecast to fall by more than the dead band before a worker removed
    now could be back (a cold start and a window on): a load on its way down is no load sitting
    at a threshold, which is what the dead band is for."""
    if window.requests == 0 or state.rate.trend >= 0:
        return False
    ahead = horizons(window, config).cold
    return state.rate.forecast(ahead) <= state.rate.level * (1 - config.dead_band)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@dataclass
class Planner:
    """``decide`` with its state carried from one window to the next, for a control loop."""

    profile: Profile
    slo: SLO
    limits: Limits
    config: PlannerConfig = PlannerConfig()
    state: PlannerState = PlannerState()

    def step(self, window: MetricsWindow, current: Counts) -> Decision:
        decision = decide(
            window, self.profile, self.slo, self.limits, current, self.state, self.config
        )
        self.state = decision.state
        return decision
