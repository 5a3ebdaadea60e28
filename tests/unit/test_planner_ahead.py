"""The planner looking ahead (issue 49), model-free on the hand profile: a rising load is sized
for when a new worker would serve, in one step; the warm pool is in the loop (serving for a
promotion's horizon, the pool for a cold start's, the floor a reserve that gives way to serving);
and the guards: a window without arrivals while requests run changes nothing, a worker still
loading is never drained, the way down is one step at a time, a flap earns a cooldown."""

from __future__ import annotations

import dataclasses

from pdserve.services.control.planner import rules
from pdserve.services.control.planner.decide import Decision, Planner, decide
from pdserve.services.control.planner.guards import pick_to_drain
from pdserve.services.control.planner.inputs import (
    Counts,
    Limits,
    MetricsWindow,
    PlannerConfig,
    PlannerState,
    RoleState,
)
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import RateSchedule, SimConfig
from pdserve.services.control.planner.simulate import simulate
from pdserve.services.control.planner.workload import SLO, Workload
from tests.unit.planner_support import DECODE_TOKENS_PER_S, hand_profile, window

PROFILE = hand_profile()
SLO_ = SLO(ttft_ms=1000, itl_ms=30, percentile="p99")
OSL = 0.5 * DECODE_TOKENS_PER_S / 10  # 0.05 decode workers per req/s: 20 req/s a worker
COLD = PlannerConfig(use_pool=False)  # serving sized for a cold start, no pool above the floor


def rising(planner: Planner, rates: list[float], current: Counts) -> list[Decision]:
    """Windows of these rates (30 s, decode-bound), the counts following the decisions."""
    out = []
    for rate in rates:
        decision = planner.step(window(rate=rate, osl=OSL, decode=current.decode), current)
        out.append(decision)
        current = decision.counts
    return out


# ---- sized steps ------------------------------------------------------------------------------


def test_a_rising_load_is_sized_for_when_a_new_worker_serves_in_one_step() -> None:
    """10 req/s rising 10 a window (30 s): a worker asked for now serves after its 60 s start,
    and the next decision's a window later, so the planner sizes for 3.5 windows past the last
    one's middle. Once the trend is known it adds all it needs at once (several workers in one
    action), where the present rate alone would add one at a time."""
    rates = [10.0, 10.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    ahead = rising(Planner(PROFILE, SLO_, Limits(), COLD), rates, Counts(1, 1))
    present = [max(1, -(-r * 0.05 // 1)) for r in rates]  # ceil(rate / 20): the bare arithmetic
    steps = [b.decode - a.decode for a, b in zip(ahead, ahead[1:], strict=False)]
    assert max(steps) >= 2, [d.decode for d in ahead]
    assert max(b - a for a, b in zip(present, present[1:], strict=False)) == 1
    last = ahead[-1]
    assert rules.FORECAST in last.rules and last.ahead is not None
    assert last.ahead.rate > 50 + 2 * 10  # planned well past the present rate
    assert last.decode > present[-1]
    assert any("3.5 windows ahead" in r for r in last.reasons)


def test_the_start_latency_measured_sets_the_horizon() -> None:
    """The same rising windows with a measured 15 s start look 2 windows ahead, not 3.5."""

    def planned(cold_start_s: float | None) -> float:
        planner = Planner(PROFILE, SLO_, Limits(), COLD)
        for rate in (10.0, 10.0, 20.0, 30.0):
            w = dataclasses.replace(window(rate=rate, osl=OSL), cold_start_s=cold_start_s)
            decision = planner.step(w, Counts(1, 1))
        assert decision.ahead is not None
        return decision.ahead.rate

    assert planned(15.0) < planned(None) - 10


def test_a_falling_load_is_not_planned_ahead() -> None:
    """The forecast says lower, but a worker removed early could not be back in time: the
    need is the present level's, and the way down is the guards'."""
    planner = Planner(PROFILE, SLO_, Limits(), COLD)
    falling = rising(planner, [80.0, 80.0, 70.0, 60.0, 50.0], Counts(1, 4))
    last = falling[-1]
    assert last.ahead is not None and last.ahead.rate >= planner.state.rate.level - 1e-9
    assert planner.state.rate.trend < 0 and rules.FORECAST not in last.rules


# ---- the warm pool in the loop ----------------------------------------------------------------


def test_serving_holds_the_pools_horizon_and_the_pool_the_rest() -> None:
    """With the pool in the loop, serving is sized for a promotion's horizon (the pool's workers
    serve at once) and the pool holds what a cold start's horizon needs beyond it: together
    they are at least what the cold horizon alone asks of serving."""
    rates = [10.0, 10.0, 10.0, 20.0, 30.0, 40.0]
    cold = rising(Planner(PROFILE, SLO_, Limits(), COLD), rates, Counts(1, 1))[-1]
    pooled = rising(Planner(PROFILE, SLO_, Limits()), rates, Counts(1, 1))[-1]
    assert pooled.decode < cold.decode
    assert pooled.decode + pooled.pool.decode >= cold.decode
    assert cold.pool == Counts(0, 0)


def test_pooled_workers_count_as_capacity_available_at_once() -> None:
    """Two loaded pooled decode workers, the load needs one more serving: the planner counts the
    pool left after that promotion and starts none to replace it (here it even stops the one
    left, which no forecast needs); in the fleet, a promoted worker serves after ``promote_s``,
    a cold start after ``startup_s``."""
    w = dataclasses.replace(
        window(rate=50, osl=OSL, decode=2), pool=Counts(0, 2), pool_ready=Counts(0, 2)
    )
    got = decide(w, PROFILE, SLO_, Limits(), Counts(1, 2), PlannerState())
    assert got.decode == 3  # 50 req/s: 2.5 workers
    assert got.pool.decode <= 1, got.reasons  # what is left of the pool: none started

    def first_served(pool: int) -> float:
        asks = iter([Counts(1, 1), Counts(1, 2)])

        def step(_: MetricsWindow, current: Counts) -> Decision:
            counts = next(asks, Counts(1, 2))
            return Decision(
                prefill=1,
                decode=counts.decode,
                reasons=(),
                state=PlannerState(),
                need={},
                rules=(),
                pool=Counts(0, pool if counts.decode == 1 else 0),
            )

        cfg = SimConfig(pool=Counts(0, pool), promote_s=1.0, startup_s=60.0)
        load = RateSchedule.constant(2, 120)
        result = simulate(
            PROFILE,
            Workload(0, 100, 50),
            load,
            SLO_,
            planner=step,
            limits=Limits(budget=8),
            config=cfg,
        )
        return next(w.t for w in result.windows if w.serving.decode == 2)

    assert first_served(pool=1) == 30.0  # asked at the 20 s window, serving at 21 s
    assert first_served(pool=0) == 90.0  # ... serving at 80 s


def test_the_floor_is_a_reserve_that_gives_way_to_serving() -> None:
    """--warm-decode-workers 1: at a low load one decode worker waits loaded; serving workers
    the load does not need count as that reserve; and when the budget binds, serving comes
    first."""
    floor = PlannerConfig(pool_floor=Counts(0, 1))
    low = decide(window(rate=10, osl=OSL), PROFILE, SLO_, Limits(), Counts(1, 1), PlannerState())
    assert low.pool == Counts(0, 0)
    low = decide(
        window(rate=10, osl=OSL), PROFILE, SLO_, Limits(), Counts(1, 1), PlannerState(), floor
    )
    assert low.pool == Counts(0, 1)
    spare = decide(
        window(rate=10, osl=OSL, decode=2),
        PROFILE,
        SLO_,
        Limits(),
        Counts(1, 2),
        PlannerState(),
        floor,
    )  # the dead band keeps 2 where 1 would do (and the streak): one spare, no pool needed
    assert spare.decode == 2 and spare.pool == Counts(0, 0)
    tight = decide(
        window(rate=50, osl=OSL, decode=3),
        PROFILE,
        SLO_,
        Limits(budget=4),
        Counts(1, 3),
        PlannerState(),
        floor,
    )
    assert tight.counts == Counts(1, 3) and tight.pool == Counts(0, 0)
    assert Limits(budget=4).cost(tight.counts) + tight.pool.decode <= 4


def test_the_floor_counts_spare_capacity_within_the_dead_band() -> None:
    """The reserve is capacity available at once, counted as the serving fleet counts its own
    margin: 5 decode workers at 4.05 workers' worth of load have 0.95 of a worker spare, within
    the dead band's 10% of 5 of the floor's one, so no pooled worker is started for the 0.05 a
    noisy window asks; 1 worker at half a worker's load has too little spare (0.5 short of 1,
    against 0.1), so one waits loaded; and at 4.75 workers' worth 5 keep too little."""
    floor = PlannerConfig(pool_floor=Counts(0, 1))

    def pool(rate: float, decode: int) -> int:
        w = window(rate=rate, osl=OSL, decode=decode)
        got = decide(w, PROFILE, SLO_, Limits(), Counts(1, decode), PlannerState(), floor)
        assert got.decode == decode
        return got.pool.decode

    assert pool(81.0, 5) == 0
    assert pool(10.0, 1) == 1
    assert pool(95.0, 5) == 1


def test_a_pool_no_longer_needed_shrinks_after_the_streak_not_a_replacement_time() -> None:
    """A pooled decode worker that grew a window ago, at a load the serving fleet holds: the
    pool's hysteresis is serving's streak (two windows that ask for less), not a replacement
    time since it grew (90 s here): it waits one window, then stops; within a cooldown earned
    by flapping it holds."""
    w = dataclasses.replace(
        window(rate=50, osl=OSL, decode=3), pool=Counts(0, 1), pool_ready=Counts(0, 1)
    )
    grew = PlannerState(decode=RoleState(pool_since_up_s=0.0))
    planner = Planner(PROFILE, SLO_, Limits(), state=grew)
    first = planner.step(w, Counts(1, 3))
    assert first.decode == 3 and first.pool.decode == 1, first.reasons
    assert rules.STREAK in first.rules and planner.state.decode.pool_streak == 1
    second = planner.step(w, Counts(1, 3))
    assert second.pool.decode == 0, second.reasons  # 60 s after it grew, under 90 s
    flapped = PlannerState(decode=RoleState(pool_since_up_s=0.0, cooldown_s=600.0))
    planner = Planner(PROFILE, SLO_, Limits(), state=flapped)
    for _ in range(3):
        assert planner.step(w, Counts(1, 3)).pool.decode == 1


# ---- guards -----------------------------------------------------------------------------------


def test_no_arrivals_while_requests_run_changes_nothing() -> None:
    """A window without arrivals, with a stream still running (a stalled client, a lost scrape):
    no scale-down to the minimum, no pool change, and the forecaster is not fed the 0 (its
    rebound would read as a surge)."""
    planner = Planner(PROFILE, SLO_, Limits())
    rising(planner, [40.0, 40.0], Counts(1, 2))
    before = planner.state
    quiet = dataclasses.replace(
        window(rate=0, decode=4, kv=0.3, running=2), pool=Counts(0, 1), pool_ready=Counts(0, 1)
    )
    got = planner.step(quiet, Counts(1, 4))
    assert got.counts == Counts(1, 4) and got.pool == Counts(0, 1)
    assert rules.IDLE_WINDOW in got.rules
    assert got.state.rate == before.rate
    # the same window with nothing running is zero demand: the need is 0
    idle = planner.step(window(rate=0, decode=4, kv=0.0, running=0), Counts(1, 4))
    assert rules.ZERO_DEMAND in idle.rules and idle.need["decode"] == 0.0


def test_a_worker_still_loading_is_never_drained() -> None:
    """The load fell, but one decode worker is still loading: the role holds (SIGTERM would
    kill it before it can drain), and the drain pick never names it."""
    w = window(rate=10, osl=OSL, decode=3)
    loading = dataclasses.replace(w.workers[-1], loading=True, running=0, kv_usage=0.0)
    w = dataclasses.replace(w, workers=(*w.workers[:-1], loading))
    met = PlannerState(decode=RoleState(down_streak=1))
    got = decide(w, PROFILE, SLO_, Limits(), Counts(1, 3), met)
    assert got.decode == 3 and rules.WARMUP in got.rules
    assert loading.worker_id not in pick_to_drain(w, "decode", 3)
    ready = dataclasses.replace(
        w, workers=(*w.workers[:-1], dataclasses.replace(loading, loading=False))
    )
    assert decide(ready, PROFILE, SLO_, Limits(), Counts(1, 3), met).decode == 2


def test_the_way_down_is_one_step_at_a_time() -> None:
    """The load fell from 4 decode workers' worth to 1: a scale-down removes one worker per
    streak, each checked against the load the survivors then carry."""
    planner = Planner(PROFILE, SLO_, Limits())
    current, path, said = Counts(1, 4), [], set()
    for _ in range(8):
        decision = planner.step(window(rate=10, osl=OSL, decode=current.decode), current)
        current = decision.counts
        path.append(current.decode)
        said |= set(decision.rules)
    assert path == [4, 3, 3, 2, 2, 1, 1, 1], path
    assert rules.ONE_STEP in said and rules.STREAK in said
    bulk = Planner(PROFILE, SLO_, Limits(), PlannerConfig(down_step=0))
    assert rising(bulk, [10.0, 10.0], Counts(1, 4))[-1].decode == 1  # without the rule


def test_a_falling_load_is_followed_down_without_the_dead_band() -> None:
    """At 38 req/s (1.9 decode workers' worth) a steady load holds 3 workers: the dead band
    keeps the margin a load sitting at a threshold needs. The same rate at the end of a fall of
    8 req/s a window is no such load: it is forecast under the band within a replacement time,
    so the fall is the margin, and the role goes down to what the load needs (after the
    streak, one step at a time, as ever)."""
    steady = rising(Planner(PROFILE, SLO_, Limits()), [38.0] * 6, Counts(1, 3))
    assert [d.decode for d in steady] == [3] * 6 and rules.DEAD_BAND in steady[-1].rules
    fall = rising(
        Planner(PROFILE, SLO_, Limits()), [70.0, 62.0, 54.0, 46.0, 38.0, 30.0, 30.0], Counts(1, 3)
    )
    assert rules.FALLING in fall[-2].rules and fall[-2].need["decode"] < 2
    assert fall[-1].decode == 2, [d.decode for d in fall]


def test_a_falling_load_drains_on_the_first_window_that_asks() -> None:
    """A steady load's scale-down waits for a two-window streak (one noisy window is no trend);
    a load forecast to fall already is one, its trend fitted over many windows: each step down
    is taken on the first window whose need fits fewer workers, one step at a time."""
    fall = rising(
        Planner(PROFILE, SLO_, Limits()), [70.0, 62.0, 54.0, 46.0, 38.0, 30.0, 30.0], Counts(1, 4)
    )
    assert [d.decode for d in fall] == [4, 4, 4, 3, 3, 2, 2], [d.decode for d in fall]
    assert all(rules.STREAK not in d.rules for d in fall)
    assert rules.FALLING in fall[3].rules and fall[3].need["decode"] < 3
    steady = rising(Planner(PROFILE, SLO_, Limits()), [10.0, 10.0, 10.0], Counts(1, 3))
    assert [d.decode for d in steady] == [3, 2, 2] and rules.STREAK in steady[0].rules


def test_a_flap_earns_a_cooldown() -> None:
    """A scale-up soon after a scale-down undid it: the role is not scaled down again until the
    load has not needed its workers for at least the cycle just seen (and twice the last
    cooldown); a role that never flapped has none, and without the rule it goes down again."""

    def run(config: PlannerConfig) -> tuple[Planner, list[Decision]]:
        planner = Planner(PROFILE, SLO_, Limits(), config)
        current, seen = Counts(1, 2), []
        for rate in [10.0] * 2 + [15.0] + [5.0] * 8:
            seen.append(planner.step(window(rate=rate, osl=OSL, decode=current.decode), current))
            current = seen[-1].counts
        return planner, seen

    planner, seen = run(PlannerConfig())
    assert [d.decode for d in seen[:3]] == [2, 1, 2]  # down, then up again 30 s later: a flap
    assert any("a flap" in r for r in seen[2].reasons)
    assert seen[2].state.decode.cooldown_s >= 2 * (60 + 30)
    assert all(d.decode == 2 for d in seen[3:]) and rules.COOLDOWN in seen[-1].rules
    _, free = run(PlannerConfig(flap_starts=0))
    assert free[-1].decode == 1 and all(d.state.decode.cooldown_s == 0 for d in free)


def test_a_sawtooth_load_does_not_make_it_flap() -> None:
    """1 -> 16 -> 1 req/s every 2 minutes for 24 minutes on the H200-like profile, 60 s starts:
    a worker removed in a trough is needed again before a new one could load. The planner learns
    it (each flap at least doubles the role's cooldown) and holds its peak's fleet: the last 12
    minutes see a few changes, where without the rule it turns with every cycle."""
    h200, slo, budget = Profile.synthetic(), SLO(ttft_ms=1000, itl_ms=30), Limits(budget=8)
    saw = RateSchedule.sawtooth(1, 16, 120, 1440)

    def run(config: PlannerConfig) -> tuple[int, int, float]:
        step = Planner(h200, slo, budget, config).step
        result = simulate(h200, Workload(0, 3000, 300), saw, slo, planner=step, limits=budget)
        late = [w.desired for w in result.windows if w.t > 720 and w.desired is not None]
        moves = sum(
            (a.prefill != b.prefill) + (a.decode != b.decode)
            for a, b in zip(late, late[1:], strict=False)
        )
        return moves, result.reversals(3 * (60 + 10)), result.attainment(slo)

    moves, flaps, attained = run(PlannerConfig())
    free_moves, free_flaps, free_attained = run(PlannerConfig(flap_starts=0))
    assert moves <= 8 and flaps <= 4, (moves, flaps)
    assert free_moves >= 2 * moves + 8 and free_flaps > flaps, (free_moves, free_flaps)
    assert attained > free_attained
