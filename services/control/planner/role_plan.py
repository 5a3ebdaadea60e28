"""One role's part of a decision (decide.py): its serving target after the scale-down guards,
its warm pool's target, and what the planner remembers of it for the next window (its streak,
its clocks, and the cooldown its flaps have earned)."""

from __future__ import annotations

import dataclasses
import math

from pdserve.services.control.planner.demand import Sizing
from pdserve.services.control.planner.guards import band, survivors
from pdserve.services.control.planner.inputs import (
    Counts,
    Limits,
    MetricsWindow,
    PlannerConfig,
    RoleState,
)
from pdserve.services.control.planner.rules import (
    COOLDOWN,
    DEAD_BAND,
    MIN_MAX,
    ONE_STEP,
    POOL,
    STREAK,
    SURVIVORS,
    WARMUP,
    Notes,
)
from pdserve.services.control.planner.sizing import ceil_workers


def serving_target(
    role: str,
    sizing: Sizing | None,
    window: MetricsWindow,
    limits: Limits,
    current: Counts,
    memory: RoleState,
    config: PlannerConfig,
    run: Notes,
    falling: bool = False,
) -> tuple[int, int]:
    """One role's serving target after the guards, and its new down streak. ``falling``: the
    load is forecast to fall by more than the dead band within a replacement time, so the fall
    itself is the margin the dead band would keep, and its trend the evidence the streak would
    collect (the survivors' check, the one step and the warm pool still stand between a noisy
    window and a drain)."""
    cur, streak = current.of(role), memory.down_streak
    need = sizing.need if sizing is not None else 0.0
    target = band(sizing, cur, 0.0 if falling else config.dead_band)
    if target == cur and ceil_workers(need) < cur:
        run.note(
            DEAD_BAND,
            f"{role}: hold {cur}: the load ({need:.2f} workers) does not fit {cur - 1}"
            f" with a {config.dead_band:.0%} margin",
        )
    bounded = min(limits.max_of(role), max(limits.min_of(role), target))
    if bounded != target:
        run.note(
            MIN_MAX,
            f"{role}: {target} -> {bounded} within [{limits.min_of(role)}, {limits.max_of(role)}]",
        )
    target = bounded
    if target >= cur:
        return target, 0
    workers = window.of(role)
    young = [w for w in workers if w.loading or w.age_s < config.warmup_s]
    kept, why = survivors(workers, target, config)
    if memory.since_needed_s < memory.cooldown_s:
        run.note(
            COOLDOWN,
            f"{role}: hold {cur}: the load needed them {memory.since_needed_s:g} s ago, within"
            f" its {memory.cooldown_s:.0f} s cooldown (it flapped before)",
        )
        return cur, 0
    if young:
        run.note(WARMUP, f"{role}: hold {cur}: {len(young)} worker(s) loading or in warm-up")
        return cur, 0
    if kept > target:
        run.note(SURVIVORS, f"{role}: keep {min(kept, cur)}, not {target}: {why}")
        target = min(kept, cur)
        if target >= cur:
            return cur, 0
    streak += 1
    # a load forecast to fall has the streak's evidence already: its trend is many windows'
    windows = 1 if falling else config.scale_down_windows
    if streak < windows:
        run.note(
            STREAK,
            f"{role}: {cur} -> {target} wanted, window {streak} of {windows}",
        )
        return cur, streak
    if config.down_step and cur - target > config.down_step and sizing is not None:
        run.note(ONE_STEP, f"{role}: {cur} -> {cur - config.down_step}, not {target}: one step")
        target = cur - config.down_step
    return target, 0


def replacement_s(window: MetricsWindow, config: PlannerConfig) -> float:
    """How long a worker removed now takes to be back: a cold start and a window."""
    cold = config.cold_start_s if window.cold_start_s is None else window.cold_start_s
    return cold + window.duration_s


def pool_target(
    role: str,
    upper: int | None,
    serving: int,
    need: float,
    window: MetricsWindow,
    current: Counts,
    memory: RoleState,
    config: PlannerConfig,
    run: Notes,
) -> tuple[int, int]:
    """One role's pool target: the upper outlook beyond the serving target, and at least the
    floor's reserve of capacity available at once (serving capacity beyond the need, which the dead
    band keeps, is such capacity too, fractionally: the reserve is short only by more than the dead
    band's share of the serving fleet, the margin a count is held within itself); shrunk only
    after ``scale_down_windows`` windows in a row asked for less (its new streak comes back with
    it), never within the role's cooldown after it last grew (a load that keeps turning would have
    it started again), and never grown while the role drains."""
    spare = max(0.0, serving - need)
    short = config.pool_floor.of(role) - spare - config.dead_band * serving
    floor = max(0, math.ceil(round(short, 9)))
    want = max(floor, (upper or 0) - serving)
    left = pool_left(role, window, current, serving)
    falling = memory.since_down_s < min(memory.since_up_s, replacement_s(window, config))
    if want > left and (serving < current.of(role) or falling):
        # the role is on its way down (it drains now, or shrank within a replacement time and
        # has not grown since): a pooled worker started now would replace the one drained
        want = max(min(floor, left), left)
    streak = 0
    if want < left and memory.pool_since_up_s < memory.cooldown_s:
        run.note(
            COOLDOWN,
            f"{role} pool: keep {left}, not {want}: grew {memory.pool_since_up_s:g} s ago, within"
            f" its {memory.cooldown_s:.0f} s cooldown",
        )
        want = left
    elif want < left:
        # the pool's hysteresis is serving's: windows in a row that asked for less, not a
        # replacement time since it grew (a pooled worker the outlook no longer wants costs a
        # GPU a second while it waits, whatever its loading cost; a load that turns back within
        # the streak keeps it, and one that keeps turning has earned the cooldown above)
        streak = memory.pool_streak + 1
        if streak < config.scale_down_windows:
            run.note(
                STREAK,
                f"{role} pool: {left} -> {want} wanted, window {streak} of"
                f" {config.scale_down_windows}",
            )
            want = left
        else:
            streak = 0
    if want != left:
        run.note(
            POOL,
            f"{role} pool: {left} -> {want} (the forecast's upper bound needs {upper or 0},"
            f" serving {serving}, floor {floor})",
        )
    return want, streak


def pool_left(role: str, window: MetricsWindow, current: Counts, serving: int) -> int:
    """The pool once the scale-up is served: promotions take pooled workers first."""
    return max(0, window.pool.of(role) - max(0, serving - current.of(role)))


def remember(
    role: str,
    memory: RoleState,
    streak: int,
    needed: bool,
    before: Counts,
    after: Counts,
    pool: Counts,
    window: MetricsWindow,
    config: PlannerConfig,
    run: Notes,
) -> RoleState:
    """The role's memory after this decision: its streak, its clocks, and its cooldown, doubled
    when a scale-up undoes a recent scale-down (a flap)."""
    memory = dataclasses.replace(memory, down_streak=streak)
    if needed:
        memory = dataclasses.replace(memory, since_needed_s=0.0)
    if pool.of(role) > pool_left(role, window, before, after.of(role)):
        memory = dataclasses.replace(memory, pool_since_up_s=0.0)
    if after.of(role) < before.of(role):
        return dataclasses.replace(memory, since_down_s=0.0)
    if after.of(role) == before.of(role):
        return memory
    flap = config.flap_starts * replacement_s(window, config)
    cooldown = memory.cooldown_s
    if memory.since_down_s < min(flap, memory.since_up_s):  # its last move was that down
        # long enough to have held through the cycle just seen (up, down, up again), and
        # twice the last one: a load that keeps turning is held at its peak's count
        cycle = memory.since_up_s + window.duration_s
        cooldown = min(config.cooldown_max * flap, max(flap, 2 * cooldown, cycle))
        run.note(
            COOLDOWN,
            f"{role}: up {memory.since_down_s:g} s after a scale-down: a flap; no scale-down for"
            f" {cooldown:.0f} s after a scale-up now",
        )
    return dataclasses.replace(memory, since_up_s=0.0, cooldown_s=cooldown)
