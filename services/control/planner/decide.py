"""One planner decision: a pure function of a metrics window, the profile, the SLOs, the limits,
the current worker counts and the planner's own state (no clock, no globals; the new state comes
back in the ``Decision``).

The arithmetic is sizing.py's. Around it stand named rules, each against a failure seen in the
field (NVIDIA Dynamo's planner issues) or a practice of llm-d's variant autoscaler:

- ``warm-up`` (dy#12430, cold-start samples inflate the counts): latency samples are not used to
  update a role's correction while any worker of that role is younger than ``warmup_s`` (its first
  requests pay compilation and cache warm-up), and a role with such a worker is not scaled down
  (it has not taken its share of the load yet);
- ``few-requests``: a window with fewer than ``min_requests`` requests leaves both corrections as
  they were (a percentile of a handful of samples is noise). Its rate still counts: zero is a rate;
- ``zero-demand`` (dy#11624, dy#14251, never scaled down at zero demand): a window without
  requests has no TTFT or ITL, and that must not stall the planner: the need is zero and the
  counts go to the minimum, subject to the same in-flight and hysteresis checks as any scale-down;
- ``trend``: a worker asked for now serves only after its start-up, so a rising rate is planned
  ``trend_windows`` windows ahead (linearly; a falling one is not: scale-down has its own
  guards). Dynamo offers constant, ARIMA and Prophet predictors; this is the simplest that looks
  ahead, and 0 makes it the constant one;
- ``backlog``: requests queued at a role's workers are demand too: the rate a role is sized for
  is the arrival rate plus its queue spread over one window, so a backlog built while workers
  started is cleared rather than carried;
- ``dead-band`` (hysteresis): a role scales up as soon as ceil(need) exceeds its count, but down to
  n only when the need fits n workers with a margin, need <= n x (1 - dead_band); a load sitting
  exactly at a threshold therefore moves the count once and then holds it;
- ``scale-down-streak`` (hysteresis): a scale-down happens only after ``scale_down_windows``
  consecutive windows all asked for one;
- ``survivors`` (dy#9294, oscillation between 2 and 1 under constant load; llm-d simulates a
  scale-down first): before removing workers, the load they carry now (KV usage and queued
  requests, summed over the role) is spread over the survivors; if a survivor would be saturated
  (KV usage >= ``kv_saturation`` or queue >= ``queue_saturation``) fewer workers are removed;
- ``min-max``: each role stays within its limits;
- ``budget`` (dy#12428, exceeded the GPU budget): the fleet's cost (workers x cost per role) never
  exceeds the budget. When it binds, the split that serves the largest share of the demand is kept
  (a prefill/decode pipeline serves only as much as its scarcer role allows), and the decision
  says which role got fewer workers than it needs, and why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.services.control.planner.inputs import (
    ROLES,
    Counts,
    Limits,
    MetricsWindow,
    PlannerConfig,
    PlannerState,
    WorkerSample,
)
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sizing import (
    DecodeSizing,
    PrefillSizing,
    ceil_workers,
    decode_correction,
    prefill_correction,
    size_decode,
    size_prefill,
)
from pdserve.services.control.planner.workload import SLO

WARMUP = "warm-up"
FEW_REQUESTS = "few-requests"
ZERO_DEMAND = "zero-demand"
BACKLOG = "backlog"
TREND = "trend"
DEAD_BAND = "dead-band"
STREAK = "scale-down-streak"
SURVIVORS = "survivors"
MIN_MAX = "min-max"
BUDGET = "budget"


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    reasons: tuple[str, ...]  # the arithmetic and every rule that acted, in order
    state: PlannerState
    need: dict[str, float]  # fractional workers per role: the arithmetic (trend, backlog in)
    rules: tuple[str, ...]  # names of the rules that changed a count or discarded samples

    @property
    def counts(self) -> Counts:
        return Counts(self.prefill, self.decode)


def _corrections(
    window: MetricsWindow, profile: Profile, state: PlannerState, config: PlannerConfig
) -> tuple[PlannerState, list[str], list[str]]:
    """Update the corrections from this window's latencies, unless its samples are suspect."""
    reasons: list[str] = []
    rules: list[str] = []
    lo, hi = config.correction_bounds
    updates: dict[str, float] = {}
    for role, observed in (("prefill", window.ttft_ms), ("decode", window.itl_ms)):
        old = getattr(state, f"{role}_correction")
        young = [w for w in window.of(role) if w.age_s < config.warmup_s]
        if window.requests < config.min_requests:
            rules.append(FEW_REQUESTS)
            reasons.append(
                f"{role} correction kept at {old:.2f}: {window.requests} requests <"
                f" {config.min_requests} [{FEW_REQUESTS}]"
            )
            continue
        if young:
            rules.append(WARMUP)
            reasons.append(
                f"{role} correction kept at {old:.2f}: {len(young)} {role} worker(s) younger than"
                f" the {config.warmup_s:g} s warm-up [{WARMUP}]"
            )
            continue
        if observed is None or window.mean_isl <= 0:
            continue
        if role == "prefill":
            raw = prefill_correction(profile, observed, window.mean_isl)
            what = f"TTFT {observed:.1f} ms / profiled {profile.prefill_seconds(window.mean_isl) * 1e3:.1f} ms"
        else:
            workers = window.of("decode")
            # the batch a token sees (weighted by batch): a mean over workers would let an idle
            # new worker halve it while the busy one runs twice as full
            total = sum(w.running for w in workers)
            batch = sum(w.running**2 for w in workers) / total if total else 1.0
            context = window.mean_isl + window.mean_osl / 2
            raw = decode_correction(profile, observed, batch, context)
            what = (
                f"ITL {observed:.1f} ms / profiled {profile.decode_itl(max(1.0, batch), context):.1f}"
                f" ms at batch {batch:.0f}"
            )
        updates[f"{role}_correction"] = min(hi, max(lo, raw))
        reasons.append(f"{role} correction {updates[f'{role}_correction']:.2f} ({what})")
    return dataclasses.replace(state, **updates), reasons, rules


def _band(sizing: PrefillSizing | DecodeSizing | None, current: int, dead_band: float) -> int:
    """Up to what the load needs at once; down only to the fewest workers that would hold the
    load with a margin (the load scaled by 1 / (1 - dead_band)); otherwise stay."""
    if sizing is None:  # no demand
        return 0
    up = sizing.workers_at(1.0)
    if up > current:
        return up
    return min(current, sizing.workers_at(1.0 / (1.0 - dead_band)))


def _survivors(workers: list[WorkerSample], target: int, config: PlannerConfig) -> tuple[int, str]:
    """The fewest survivors (>= target) none of which the role's present load would saturate."""
    kv = sum(w.kv_usage for w in workers)
    queue = sum(w.queue for w in workers)

    def saturated(n: int) -> bool:  # no survivor at all can carry no load
        if n == 0:
            return kv > 0 or queue > 0
        return kv / n >= config.kv_saturation or queue / n >= config.queue_saturation

    n = target
    while saturated(n):
        n += 1
    if n == target:
        return target, ""
    return (
        n,
        f"{target} survivors would carry KV {kv / max(target, 1):.2f}, queue {queue / max(target, 1):.1f} each",
    )


def fit_budget(wanted: Counts, need: dict[str, float], limits: Limits) -> tuple[Counts, str]:
    """The counts within the budget that serve the largest share of the demand: a P/D pipeline
    serves min(P / need_P, D / need_D) of it. Ties go to the larger fleet, then to decode."""
    if limits.budget is None or limits.cost(wanted) <= limits.budget + 1e-9:
        return wanted, ""
    best: tuple[tuple[float, float, int], Counts] | None = None
    for p in range(limits.min_prefill, wanted.prefill + 1):
        room = limits.budget - p * limits.prefill_cost
        d = min(wanted.decode, int(room / limits.decode_cost + 1e-9))
        if d < limits.min_decode:
            break
        counts = Counts(p, d)
        share = min(counts.of(r) / need[r] if need[r] > 0 else float("inf") for r in ROLES)
        key = (share, limits.cost(counts), d)
        if best is None or key > best[0]:
            best = (key, counts)
    assert best is not None  # Limits checked that the minimum fleet fits
    got = best[1]
    short = [
        f"{r} {got.of(r)} of {wanted.of(r)} (covers {got.of(r) / need[r]:.0%} of its need {need[r]:.2f})"
        for r in ROLES
        if got.of(r) < wanted.of(r) and need[r] > 0
    ] or [f"{r} {got.of(r)} of {wanted.of(r)}" for r in ROLES if got.of(r) < wanted.of(r)]
    return got, (
        f"budget {limits.budget:g} {limits.unit} binds: {wanted} costs {limits.cost(wanted):g};"
        f" kept {got} ({limits.cost(got):g}): "
        + ", ".join(short)
        + " -- the split that serves the largest share of the demand, since the scarcer role"
        " limits what the pipeline serves"
    )


def decide(
    window: MetricsWindow,
    profile: Profile,
    slo: SLO,
    limits: Limits,
    current: Counts,
    state: PlannerState,
    config: PlannerConfig = PlannerConfig(),
) -> Decision:
    reasons = [
        f"window {window.duration_s:g} s: {window.requests} requests ({window.request_rate:.2f}"
        f" req/s), ISL {window.mean_isl:.0f}, OSL {window.mean_osl:.0f}; TTFT"
        f" {_ms(window.ttft_ms)}, ITL {_ms(window.itl_ms)} at {slo.percentile}; now {current}"
    ]
    state, lines, rules = _corrections(window, profile, state, config)
    reasons += lines

    sizing: dict[str, PrefillSizing | DecodeSizing | None] = {r: None for r in ROLES}
    if window.requests > 0 and window.mean_isl <= 0:
        # requests arrived but none finished in the window (the gateway counts tokens at the
        # finish): no sizes to plan with, so hold rather than size for 1-token requests
        reasons.append(f"{window.requests} arrived, none finished: no ISL/OSL yet, hold {current}")
        return Decision(
            prefill=current.prefill,
            decode=current.decode,
            reasons=tuple(reasons),
            state=dataclasses.replace(state, last_rate=window.request_rate),
            need={r: float(current.of(r)) for r in ROLES},
            rules=tuple(dict.fromkeys(rules)),
        )
    if window.requests == 0:
        rules.append(ZERO_DEMAND)
        reasons.append(f"no requests: the need is 0, the counts go to the minimum [{ZERO_DEMAND}]")
    else:
        rate, isl, osl = window.request_rate, max(1.0, window.mean_isl), max(1.0, window.mean_osl)
        rising = rate - state.last_rate if state.last_rate is not None else 0.0
        if rising > 0 and config.trend_windows > 0:
            # new workers serve a window or more after they are asked for: meet the rate then
            ahead = rate + rising * config.trend_windows
            rules.append(TREND)
            reasons.append(
                f"rate rising {state.last_rate:.2f} -> {rate:.2f} req/s: planned for {ahead:.2f}"
                f" ({config.trend_windows:g} window(s) ahead) [{TREND}]"
            )
            rate = ahead
        extra = {r: sum(w.queue for w in window.of(r)) / window.duration_s for r in ROLES}
        for role in ROLES:
            if extra[role] > 0:
                rules.append(BACKLOG)
                reasons.append(
                    f"{role} backlog: {extra[role] * window.duration_s:.0f} queued -> +"
                    f"{extra[role]:.2f} req/s to clear it within one window [{BACKLOG}]"
                )
        sizing["prefill"] = size_prefill(
            profile, rate + extra["prefill"], isl, slo, state.prefill_correction, config.prefill_cv2
        )
        sizing["decode"] = size_decode(
            profile,
            rate + extra["decode"],
            isl,
            osl,
            slo,
            state.decode_correction,
            config.kv_saturation,
        )
        reasons += [s.explain() for s in sizing.values() if s is not None]
    need = {r: s.need if s is not None else 0.0 for r, s in sizing.items()}

    wanted = current
    streaks = {}
    for role in ROLES:
        cur, streak = current.of(role), getattr(state, f"{role}_down_streak")
        target = _band(sizing[role], cur, config.dead_band)
        if target == cur and ceil_workers(need[role]) < cur:
            rules.append(DEAD_BAND)
            reasons.append(
                f"{role}: hold {cur}: the load ({need[role]:.2f} workers) does not fit {cur - 1}"
                f" with a {config.dead_band:.0%} margin [{DEAD_BAND}]"
            )
        bounded = min(limits.max_of(role), max(limits.min_of(role), target))
        if bounded != target:
            rules.append(MIN_MAX)
            reasons.append(
                f"{role}: {target} -> {bounded} within [{limits.min_of(role)},"
                f" {limits.max_of(role)}] [{MIN_MAX}]"
            )
        target = bounded
        if target < cur:
            workers = window.of(role)
            young = [w for w in workers if w.age_s < config.warmup_s]
            kept, why = _survivors(workers, target, config)
            if young:
                rules.append(WARMUP)
                reasons.append(
                    f"{role}: hold {cur}: {len(young)} worker(s) still in warm-up [{WARMUP}]"
                )
                target = cur
            elif kept > target:
                rules.append(SURVIVORS)
                reasons.append(f"{role}: keep {min(kept, cur)}, not {target}: {why} [{SURVIVORS}]")
                target = min(kept, cur)
        if target < cur:
            streak += 1
            if streak < config.scale_down_windows:
                rules.append(STREAK)
                reasons.append(
                    f"{role}: {cur} -> {target} wanted, window {streak} of"
                    f" {config.scale_down_windows} [{STREAK}]"
                )
                target = cur
            else:
                streak = 0
        else:
            streak = 0
        streaks[f"{role}_down_streak"] = streak
        wanted = wanted.with_(role, target)

    final, why = fit_budget(wanted, need, limits)
    if why:
        rules.append(BUDGET)
        reasons.append(f"{why} [{BUDGET}]")
    for role in ROLES:
        if final.of(role) != current.of(role):
            reasons.append(f"{role}: {current.of(role)} -> {final.of(role)}")
    return Decision(
        prefill=final.prefill,
        decode=final.decode,
        reasons=tuple(reasons),
        state=dataclasses.replace(state, last_rate=window.request_rate, **streaks),
        need=need,
        rules=tuple(dict.fromkeys(rules)),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def pick_to_drain(window: MetricsWindow, role: str, n: int) -> list[str]:
    """The ``n`` workers of a role to drain: the least loaded (fewest requests held, then the
    least KV), so draining finishes soonest and moves the least."""
    ranked = sorted(window.of(role), key=lambda w: (w.running + w.queue, w.kv_usage, w.worker_id))
    return [w.worker_id for w in ranked[:n]]


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
