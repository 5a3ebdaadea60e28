"""``decide`` table-driven, with Dynamo's planner bugs as cases: oscillation 2 <-> 1 under constant
load (dy#9294), no scale-down at zero demand (dy#11624, dy#14251), a blown GPU budget
(dy#12428), cold-start samples inflating the counts (dy#12430), and flapping at a threshold.
Each guard's case also shows what the bare arithmetic wanted, so removing the guard fails it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from pdserve.services.control.planner import rules as d
from pdserve.services.control.planner.decide import Planner, decide
from pdserve.services.control.planner.forecast import HoltGains
from pdserve.services.control.planner.guards import fit_budget, fit_cores, pick_to_drain
from pdserve.services.control.planner.inputs import (
    ROLES,
    Counts,
    Limits,
    MetricsWindow,
    PlannerConfig,
    PlannerState,
    RoleState,
)
from pdserve.services.control.planner.workload import SLO
from tests.unit.planner_support import hand_profile, osl_for, window

PROFILE = hand_profile()
SLO_ = SLO(ttft_ms=1000, itl_ms=30, percentile="p99")
STREAK_MET = PlannerState(prefill=RoleState(down_streak=1), decode=RoleState(down_streak=1))


@dataclass
class Case:
    name: str
    window: MetricsWindow
    current: Counts
    expect: Counts
    rule: str | None  # the rule that must have acted (None: none of the guards)
    state: PlannerState = field(default_factory=PlannerState)
    limits: Limits = field(default_factory=Limits)


CASES = [
    # dy#9294: the arithmetic wants 1 decode worker, but the one survivor would carry both
    # workers' KV (0.45 + 0.45 >= 0.8): removing one would saturate it and bring the second back
    Case(
        "oscillation: survivors' KV",
        window(osl=osl_for(0.8, 10), decode=2, kv=0.45),
        Counts(1, 2),
        Counts(1, 2),
        d.SURVIVORS,
        STREAK_MET,
    ),
    Case(
        "oscillation: survivors' queue",
        window(osl=osl_for(0.8, 10), decode=2, decode_queue=3),
        Counts(1, 2),
        Counts(1, 2),
        d.SURVIVORS,
        STREAK_MET,
    ),
    Case(
        "the same load spread thin scales down",
        window(osl=osl_for(0.8, 10), decode=2, kv=0.3),
        Counts(1, 2),
        Counts(1, 1),
        None,
        STREAK_MET,
    ),
    # dy#11624 / dy#14251: no requests, no latencies: still the minimum, once the streak is met
    Case(
        "zero demand -> minimum",
        window(rate=0, prefill=4, decode=6, kv=0.0, running=0),
        Counts(4, 6),
        Counts(1, 1),
        d.ZERO_DEMAND,
        STREAK_MET,
    ),
    Case(
        "zero demand -> minimum 0",
        window(rate=0, prefill=4, decode=6, kv=0.0, running=0),
        Counts(4, 6),
        Counts(0, 0),
        d.ZERO_DEMAND,
        STREAK_MET,
        Limits(min_prefill=0, min_decode=0),
    ),
    Case(
        "zero demand waits one window",
        window(rate=0, prefill=4, decode=6, kv=0.0, running=0),
        Counts(4, 6),
        Counts(4, 6),
        d.STREAK,
    ),
    Case(
        "zero demand keeps workers still holding requests",
        window(rate=0, decode=3, kv=0.7, running=0),
        Counts(1, 3),
        Counts(1, 3),
        d.SURVIVORS,
        STREAK_MET,
    ),
    # dy#12430: a decode worker in warm-up sees 200 ms ITLs; they must not 4x the decode target
    Case(
        "cold-start ITL discarded",
        window(osl=osl_for(0.8, 10), itl_ms=200.0, age=5.0),
        Counts(1, 1),
        Counts(1, 1),
        d.WARMUP,
    ),
    Case(
        "cold-start: few requests discarded",
        window(rate=0.2, osl=50, itl_ms=200.0),
        Counts(1, 1),
        Counts(1, 1),
        d.FEW_REQUESTS,
    ),
    Case(
        "warm-up: no scale-down while a worker warms",
        window(osl=osl_for(0.8, 10), decode=2, kv=0.1, age=[600.0, 5.0]),
        Counts(1, 2),
        Counts(1, 2),
        d.WARMUP,
        STREAK_MET,
    ),
    # hysteresis: need 1.9 fits 2 workers, but only at 95%, inside the 10% band: 3 stay
    Case(
        "dead band holds",
        window(osl=osl_for(1.9, 10), decode=3),
        Counts(1, 3),
        Counts(1, 3),
        d.DEAD_BAND,
        STREAK_MET,
    ),
    Case(
        "dead band: need exactly 2.0 keeps 3",
        window(osl=osl_for(2.0, 10), decode=3),
        Counts(1, 3),
        Counts(1, 3),
        d.DEAD_BAND,
        STREAK_MET,
    ),
    Case(
        "below the band it scales down",
        window(osl=osl_for(1.7, 10), decode=3),
        Counts(1, 3),
        Counts(1, 2),
        None,
        STREAK_MET,
    ),
    Case(
        "scale-down waits for the streak",
        window(osl=osl_for(1.7, 10), decode=3),
        Counts(1, 3),
        Counts(1, 3),
        d.STREAK,
    ),
    Case(
        "scale-up is immediate",
        window(osl=osl_for(2.01, 10), decode=2),
        Counts(1, 2),
        Counts(1, 3),
        None,
    ),
    Case(
        "max binds", window(osl=osl_for(11.5, 10), decode=8), Counts(1, 8), Counts(1, 8), d.MIN_MAX
    ),
    Case(
        "budget binds",
        window(rate=40, isl=1000, osl=200, decode=6),
        Counts(5, 6),
        Counts(4, 4),
        d.BUDGET,
        limits=Limits(budget=8),
    ),  # need 4.48P 5.85D: 4/4.48, 4/5.85
    Case(
        "prefill backlog adds prefill",
        window(isl=400, prefill_queue=600),
        Counts(1, 1),
        Counts(2, 1),
        d.BACKLOG,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case) -> None:
    got = decide(case.window, PROFILE, SLO_, case.limits, case.current, case.state)
    assert got.counts == case.expect, "\n".join(got.reasons)
    if case.rule:
        assert case.rule in got.rules
        assert any(f"[{case.rule}]" in r for r in got.reasons), got.reasons
    guards = {d.SURVIVORS, d.ZERO_DEMAND, d.DEAD_BAND, d.STREAK, d.WARMUP, d.BUDGET, d.MIN_MAX}
    if case.rule is None:
        assert not guards & set(got.rules), got.rules
    assert got.reasons[0].startswith("window 30 s")
    if case.limits.budget is not None:
        assert case.limits.cost(got.counts) <= case.limits.budget


def test_the_guarded_cases_differ_from_the_bare_arithmetic() -> None:
    """Had the guard not acted, the arithmetic alone would have moved the count."""
    for case in CASES:
        if case.rule in (d.SURVIVORS, d.DEAD_BAND, d.STREAK, d.BUDGET):
            got = decide(case.window, PROFILE, SLO_, case.limits, case.current, case.state)
            bare = Counts(*(max(1, -(-round(got.need[r], 9) // 1)) for r in ROLES))
            assert bare != got.counts or case.rule == d.BUDGET, case.name
            if case.rule == d.BUDGET:
                assert case.limits.cost(bare) > case.limits.budget


def test_cold_start_samples_would_have_inflated_decode() -> None:
    """The same window with warm workers trusts the 200 ms ITL: the correction (clamped at 4)
    makes the ITL target 7.5 ms, which no batch meets, and decode goes to its maximum."""
    warm = window(osl=osl_for(0.8, 10), itl_ms=200.0, age=600.0)
    got = decide(warm, PROFILE, SLO_, Limits(), Counts(1, 1), PlannerState())
    assert got.counts == Counts(1, 8) and got.state.decode_correction == 4.0
    cold = window(osl=osl_for(0.8, 10), itl_ms=200.0, age=5.0)
    got = decide(cold, PROFILE, SLO_, Limits(), Counts(1, 1), PlannerState())
    assert got.state.decode_correction == 1.0


def test_hysteresis_at_a_threshold_does_not_flap() -> None:
    """The load wobbles around exactly 2 decode workers' worth. Each hysteresis rule alone keeps
    the count from flapping (the dead band, the streak, the cooldown a flap earns); without them
    all, it changes nearly every window. The OSL forecaster is made transparent (it would smooth
    the wobble away) so that the rules are what is tested."""
    wobble = [osl_for(need, 10) for need in (1.99, 2.01) * 10]
    raw = HoltGains(alpha=1.0, beta=1e-9)

    def changes(**rules: float) -> int:
        planner = Planner(PROFILE, SLO_, Limits(), PlannerConfig(length_gains=raw, **rules))
        current, moves = Counts(1, 2), 0
        for osl in wobble:
            decision = planner.step(window(osl=osl, decode=current.decode), current)
            moves += decision.counts != current
            current = decision.counts
        return moves

    assert changes() <= 1
    assert changes(dead_band=0.1, scale_down_windows=1, flap_starts=0) <= 1
    assert changes(dead_band=0.0, scale_down_windows=2, flap_starts=0) <= 1
    assert changes(dead_band=0.0, scale_down_windows=1) <= 3  # one flap, then the cooldown
    assert changes(dead_band=0.0, scale_down_windows=1, flap_starts=0) >= 15


def test_fit_budget_keeps_the_balanced_split_by_hand() -> None:
    """Budget 8, each worker 1: 3P5D serves min(3/3.5, 5/5.5) = 0.857 of the demand; 2P6D only
    0.571, 4P4D 0.727."""
    need = {"prefill": 3.5, "decode": 5.5}
    got, why = fit_budget(Counts(4, 6), need, Limits(budget=8))
    assert got == Counts(3, 5)
    assert "prefill 3 of 4" in why and "decode 5 of 6" in why and "budget 8 GPU" in why
    # decode at TP 2 costs 2: 3P3D and 4P3D both serve 0.857; the fuller fleet wins
    got, _ = fit_budget(
        Counts(4, 4), {"prefill": 3.5, "decode": 3.5}, Limits(decode_cost=2, budget=10)
    )
    assert got == Counts(4, 3)
    assert fit_budget(Counts(2, 2), need, Limits(budget=8)) == (Counts(2, 2), "")
    with pytest.raises(ValueError, match="budget"):
        Limits(min_prefill=3, min_decode=3, budget=5)


def test_fit_cores_keeps_what_the_cores_can_run_by_hand() -> None:
    """2 cores, a worker 1 CPU. 1P1D -> 2P1D at needs 0.59 / 0.73 (the CPU ramp's): 3 workers on 2
    cores run at 2/3, so decode covers 0.67 / 0.73 = 0.91 of its need, against 1.37 at 1P1D."""
    cpu = Limits(budget=4, unit="CPU")
    need = {"prefill": 0.59, "decode": 0.73}
    got, why = fit_cores(Counts(2, 1), need, cpu, Counts(1, 1), 2.0)
    assert got == Counts(1, 1) and "on 2 cores" in why and "67%" in why
    # both short: 2P2D, each worker at half a core, serves what 1P1D does; the smaller fleet wins
    got, _ = fit_cores(Counts(2, 2), {"prefill": 0.82, "decode": 1.01}, cpu, Counts(1, 1), 2.0)
    assert got == Counts(1, 1)
    # prefill short, decode with room: moving a share of a core to prefill pays (on 3 cores the
    # second prefill worker even runs at full speed)
    need = {"prefill": 1.5, "decode": 0.5}
    assert fit_cores(Counts(2, 2), need, cpu, Counts(1, 1), 3.0)[0] == Counts(2, 1)
    assert fit_cores(Counts(2, 1), need, cpu, Counts(1, 1), 2.0)[0] == Counts(2, 1)
    # within the cores, or a role asked to shrink: as wanted
    assert fit_cores(Counts(1, 1), need, cpu, Counts(2, 1), 2.0) == (Counts(1, 1), "")
    assert fit_cores(Counts(1, 2), need, cpu, Counts(2, 2), 2.0)[0].prefill == 1


def test_on_shared_cores_a_worker_that_would_split_them_is_not_added() -> None:
    """Prefill needs 1.31 workers, decode 0.97: a second prefill worker on 2 cores would leave
    decode 0.67 of one (0.69 of its need) to give prefill 1.33 (1.02): 1P1D serves 0.76."""
    w = window(rate=10, isl=900, osl=osl_for(0.95, 10), ttft_ms=500.0, itl_ms=15.0)
    cpu = Limits(budget=4, unit="CPU")
    grown = decide(w, PROFILE, SLO_, cpu, Counts(1, 1), PlannerState())
    assert grown.counts.prefill > 1 and d.CORES not in grown.rules
    shared = PlannerConfig(host_cpus=2.0)
    held = decide(w, PROFILE, SLO_, cpu, Counts(1, 1), PlannerState(), shared)
    assert held.counts == Counts(1, 1) and d.CORES in held.rules
    # the pool: the outlook's worker beyond the serving one would load on the 2 cores that
    # serve, so nothing above the floor
    assert held.pool == Counts(0, 0)
    assert any("pool 1P0D -> 0P0D: what serving leaves of the cores" in r for r in held.reasons)
    floor = dataclasses.replace(shared, pool_floor=Counts(1, 0))
    assert decide(w, PROFILE, SLO_, cpu, Counts(1, 1), PlannerState(), floor).pool == Counts(1, 0)


def test_budget_binds_even_against_the_current_fleet() -> None:
    """A fleet over a (lowered) budget is cut at once: the budget is not subject to hysteresis."""
    got = decide(window(decode=6), PROFILE, SLO_, Limits(budget=4), Counts(1, 6), PlannerState())
    assert got.counts == Counts(1, 3) and d.BUDGET in got.rules


def test_the_planner_carries_its_state_to_the_minimum() -> None:
    planner = Planner(PROFILE, SLO_, Limits())
    idle = window(rate=0, prefill=3, decode=3, kv=0.0, running=0)
    first = planner.step(idle, Counts(3, 3))
    assert first.counts == Counts(3, 3) and planner.state.decode.down_streak == 1
    assert planner.step(idle, Counts(3, 3)).counts == Counts(1, 1)
    assert planner.state.decode.down_streak == 0


def test_decision_state_is_new_and_inputs_untouched() -> None:
    state = PlannerState()
    w = window(osl=osl_for(0.8, 10), itl_ms=15.0)
    got = decide(w, PROFILE, SLO_, Limits(), Counts(1, 1), state)
    assert state == PlannerState()  # frozen: decide returns a new one
    assert got.state.decode_correction == pytest.approx(15.0 / PROFILE.decode_itl(10, 150))
    assert got.state.prefill_correction == state.prefill_correction
    assert got.state.rate.n == 1 and got.state.rate.level == w.request_rate  # it saw the window


def test_pick_to_drain_takes_the_least_loaded() -> None:
    w = window(decode=3, kv=[0.5, 0.1, 0.3])
    w = dataclasses.replace(
        w, workers=tuple(dataclasses.replace(s, running=int(s.kv_usage * 10)) for s in w.workers)
    )
    assert pick_to_drain(w, "decode", 2) == ["d1", "d2"]


def test_arrivals_with_nothing_finished_hold_the_counts() -> None:
    """Requests arrived but none finished in the window: no ISL/OSL to size by, so the counts
    hold instead of being sized for one-token requests."""
    from pdserve.services.control.planner.decide import decide
    from pdserve.services.control.planner.inputs import Counts, Limits, MetricsWindow, PlannerState
    from pdserve.services.control.planner.profile import Profile
    from pdserve.services.control.planner.workload import SLO

    window = MetricsWindow(
        duration_s=10.0,
        requests=40,
        mean_isl=0.0,
        mean_osl=0.0,
        ttft_ms=None,
        itl_ms=None,
        workers=(),
    )
    current = Counts(prefill=3, decode=4)
    limits = Limits(max_prefill=8, max_decode=8)
    d = decide(window, Profile.synthetic(), SLO(500.0, 20.0), limits, current, PlannerState())
    assert d.counts == current and "none finished" in " ".join(d.reasons)
