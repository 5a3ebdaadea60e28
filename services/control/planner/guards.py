"""The arithmetic of decide.py's guards: the dead band, the survivors' check, the budget's split
between the roles, the cores a CPU host really has, the warm pool within what serving leaves of
the budget, and which workers to drain. Pure functions of counts, needs and samples."""

from __future__ import annotations

from pdserve.services.control.planner.inputs import (
    ROLES,
    Counts,
    Limits,
    MetricsWindow,
    PlannerConfig,
    WorkerSample,
)
from pdserve.services.control.planner.sizing import DecodeSizing, PrefillSizing


def band(sizing: PrefillSizing | DecodeSizing | None, current: int, dead_band: float) -> int:
    """Up to what the load needs at once; down only to the fewest workers that would hold the
    load with a margin (the load scaled by 1 / (1 - dead_band)); otherwise stay."""
    if sizing is None:  # no demand
        return 0
    up = sizing.workers_at(1.0)
    if up > current:
        return up
    return min(current, sizing.workers_at(1.0 / (1.0 - dead_band)))


def survivors(workers: list[WorkerSample], target: int, config: PlannerConfig) -> tuple[int, str]:
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


def served_share(counts: Counts, need: dict[str, float], speed: float = 1.0) -> float:
    """The share of the demand a P/D pipeline serves: min(P / need_P, D / need_D), each worker
    at ``speed`` of its own (a role with no need never limits it)."""
    return min(counts.of(r) * speed / need[r] if need[r] > 0 else float("inf") for r in ROLES)


def fit_budget(
    wanted: Counts, need: dict[str, float], limits: Limits, current: Counts | None = None
) -> tuple[Counts, str]:
    """The counts within the budget that serve the largest share of the demand: a P/D pipeline
    serves min(P / need_P, D / need_D) of it. Ties go to the larger fleet, then to decode.

    Given the ``current`` counts, the budget only trims growth: no role goes below both what it
    has and what it wanted (a drain is a scale-down, and those pass the guards first; cutting
    one role to feed the other and back is flapping). Only a fleet already over the budget (a
    budget lowered under it) is cut further, down to the minimum."""
    if limits.budget is None or limits.cost(wanted) <= limits.budget + 1e-9:
        return wanted, ""
    floor = Counts(limits.min_prefill, limits.min_decode)
    if current is not None:
        kept = Counts(*(max(floor.of(r), min(current.of(r), wanted.of(r))) for r in ROLES))
        if limits.cost(kept) <= limits.budget + 1e-9:
            floor = kept
    best: tuple[tuple[float, float, int], Counts] | None = None
    for p in range(floor.prefill, wanted.prefill + 1):
        room = limits.budget - p * limits.prefill_cost
        d = min(wanted.decode, int(room / limits.decode_cost + 1e-9))
        if d < floor.decode:
            break
        counts = Counts(p, d)
        key = (served_share(counts, need), limits.cost(counts), d)
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


def fit_cores(
    wanted: Counts, need: dict[str, float], limits: Limits, current: Counts, cpus: float
) -> tuple[Counts, str]:
    """On a host whose ``cpus`` the budget oversubscribes: the counts that serve the largest
    share of the demand when busy workers split the cores evenly. A fleet costing C CPUs on
    fewer gives each worker cpus / C of its share, so a worker beyond the cores adds its role a
    share and takes as much from every other one. Ties go to the smaller fleet: a worker that
    adds nothing still loads on the cores that serve. Only growth is trimmed: a role asked to
    shrink shrinks, one asked to grow gets between what it has and what it wanted.

    All workers busy is the case that binds (a decode worker under load always is, and a
    prefill worker whenever prompts queue): 1P1D on 2 cores -> 2P1D at a decode need of 0.73
    gives decode 0.67 of a core, which is why this stays 1P1D."""
    if limits.cost(wanted) <= cpus + 1e-9:
        return wanted, ""
    spans = {r: range(min(current.of(r), wanted.of(r)), wanted.of(r) + 1) for r in ROLES}
    best: tuple[tuple[float, float, int], Counts] | None = None
    for p in spans["prefill"]:
        for d in spans["decode"]:
            counts = Counts(p, d)
            speed = min(1.0, cpus / limits.cost(counts))
            key = (round(served_share(counts, need, speed), 9), -limits.cost(counts), d)
            if best is None or key > best[0]:
                best = (key, counts)
    assert best is not None  # the spans are never empty
    got = best[1]
    if got == wanted:
        return wanted, ""
    speed = min(1.0, cpus / limits.cost(wanted))
    return got, (
        f"{wanted} would cost {limits.cost(wanted):g} {limits.unit} on {cpus:g} cores, each"
        f" worker at {speed:.0%} of its share: kept {got}, which serves more of the demand"
        f" (prefill {need['prefill']:.2f}, decode {need['decode']:.2f} workers' worth)"
    )


def fit_pool(
    pool: Counts, floor: Counts, serving: Counts, limits: Limits, budget: float | None = None
) -> Counts:
    """The pool within what the serving fleet leaves of the budget (``budget``: this one
    instead of the limits'): serving comes first (a reserve is there to be used), then the floor,
    then what the forecast's upper bound asks above it; the role with the most pooled (above its
    floor first) gives one up at a time."""
    budget = limits.budget if budget is None else budget
    if budget is None:
        return pool
    room = budget - limits.cost(serving)
    kept = {r: pool.of(r) for r in ROLES}
    while sum(kept[r] * limits.cost_of(r) for r in ROLES) > room + 1e-9:
        above = [r for r in ROLES if kept[r] > floor.of(r)]
        pick = above or [r for r in ROLES if kept[r] > 0]
        if not pick:
            break
        role = max(pick, key=lambda r: (kept[r] - floor.of(r), r == "prefill"))
        kept[role] -= 1
    return Counts(*(kept[r] for r in ROLES))


def pick_to_drain(window: MetricsWindow, role: str, n: int) -> list[str]:
    """The ``n`` workers of a role to drain: the least loaded (fewest requests held, then the
    least KV), so draining finishes soonest and moves the least. Never one still loading: it
    holds nothing, but SIGTERM would kill it before it can drain (the warm-up rule keeps the
    planner from asking while one loads; this keeps a caller from picking it anyway)."""
    loaded = [w for w in window.of(role) if not w.loading]
    ranked = sorted(loaded, key=lambda w: (w.running + w.queue, w.kv_usage, w.worker_id))
    return [w.worker_id for w in ranked[:n]]
