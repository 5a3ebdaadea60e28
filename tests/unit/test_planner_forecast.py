"""The planner's forecaster (services/control/planner/forecast.py), model-free: Holt's filter
tracks a linear ramp with no lag, converges on a constant load, stays bounded on noise, measures
its own error ahead only where a load beat the plan, and jumps on a surge when told to."""

from __future__ import annotations

import math
import random

import pytest

from pdserve.services.control.planner.forecast import Holt, HoltGains

GAINS = HoltGains(alpha=0.4, beta=0.1)


def feed(values: list[float], gains: HoltGains = GAINS, floor: float = 0.0) -> Holt:
    state = Holt()
    for v in values:
        state = state.update(v, gains, floor)
    return state


def test_it_tracks_a_linear_ramp_without_lag() -> None:
    """8 req/s rising 2.7 a window (16 a minute in 10 s windows): after a few dozen windows the
    trend is the slope and the level the last value, so the forecast 7.5 windows on (a 60 s
    cold start) is the ramp's own value there; a moving average would lag by half its span."""
    ramp = [8 + 2.7 * k for k in range(60)]
    state = feed(ramp)
    assert state.trend == pytest.approx(2.7, rel=1e-3)
    assert state.level == pytest.approx(ramp[-1], abs=0.05)
    assert state.forecast(7.5) == pytest.approx(ramp[-1] + 2.7 * 7.5, abs=0.1)
    # and the error it measures ahead shrinks to nothing once it has caught up
    assert state.stderr(7.5, GAINS) < 0.5


def test_it_converges_on_a_constant_load() -> None:
    """From a start far off (a surge that stopped), the trend decays to 0 and the level to the
    load; nothing is planned above it then."""
    state = feed([10.0] * 5 + [40.0] * 80)
    assert state.level == pytest.approx(40.0, abs=1e-3)
    assert abs(state.trend) < 1e-3
    assert state.forecast(7.5) == pytest.approx(40.0, abs=0.01)


def test_it_stays_bounded_on_noise() -> None:
    """White noise of sd 2 around 50, 2,000 windows: the level stays within a few sd of the
    mean and the trend near 0 (each error moves them by alpha and beta of it, no more), so the
    forecast a cold start ahead stays within the noise's own range."""
    rng = random.Random(7)
    state, worst_level, worst_trend = Holt(), 0.0, 0.0
    for _ in range(2000):
        state = state.update(50 + rng.gauss(0, 2), GAINS)
        if state.n > 20:
            worst_level = max(worst_level, abs(state.level - 50))
            worst_trend = max(worst_trend, abs(state.trend))
    assert worst_level < 4 * 2 * math.sqrt(GAINS.alpha / (2 - GAINS.alpha)) + 1
    assert worst_trend < 1.5
    assert abs(state.forecast(7.5) - 50) < 12
    # its measured error ahead is the noise's scale, far below the trend model's, which lets
    # the trend wander by beta of every error
    assert 0.5 < state.stderr(7.5, GAINS) < state.model_stderr(7.5, GAINS)


def test_the_error_ahead_counts_misses_above_the_plan_only() -> None:
    """A forecast plans capacity: a load above it costs requests, one below it costs nothing.
    A surge (the load beats the plan) widens the error ahead at once; a corner where a ramp
    stops (the plan overshoots) does not."""
    flat = feed([20.0] * 30, floor=0.01)
    assert flat.stderr(4, GAINS) == pytest.approx(0.1)  # the floor: nothing missed
    surge = flat
    for v in (26.0, 32.0, 38.0):
        surge = surge.update(v, GAINS, 0.01)
    assert surge.stderr(2, GAINS) > 5
    corner = feed([20.0 + 3 * k for k in range(30)] + [110.0] * 3, floor=0.01)
    assert corner.stderr(2, GAINS) == pytest.approx(0.1, abs=0.02)


def test_the_first_window_sets_the_level_and_the_error_is_its_own_at_first() -> None:
    state = Holt().update(12.0, GAINS, noise_floor=1.2)
    assert (state.level, state.trend, state.n) == (12.0, 0.0, 1)
    assert state.forecast(3) == 12.0
    assert state.stderr(3, GAINS) == pytest.approx(math.sqrt(1.2))
    # the model's error grows with the horizon (ETS(A,A,N), FPP table 7.8)
    assert state.model_stderr(1, GAINS) == pytest.approx(math.sqrt(1.2))
    h, a, b = 3.0, GAINS.alpha, GAINS.beta
    growth = 1 + (h - 1) * (a * a + a * b * h + b * b * h * (2 * h - 1) / 6)
    assert state.model_stderr(h, GAINS) == pytest.approx(math.sqrt(1.2 * growth))


def test_a_surge_is_taken_at_once_when_asked() -> None:
    """Flat at 8 with Poisson-like noise, then a window at 14: with ``surge_sigmas`` the filter
    takes the whole jump as the new level and trend (the next 7.5 windows are planned on it);
    without, it takes alpha and beta of it. A jump of a few sd that is a small share of the load
    is noise, not a surge."""
    noise = HoltGains(alpha=0.4, beta=0.1)
    surge = HoltGains(alpha=0.4, beta=0.1, surge_sigmas=3.0)
    history = [8.0, 8.5, 7.6, 8.2, 7.9, 8.1]
    calm, alert = feed(history, noise, 0.8), feed(history, surge, 0.8)
    calm, alert = calm.update(14.0, noise, 0.8), alert.update(14.0, surge, 0.8)
    assert alert.level == pytest.approx(14.0) and alert.trend > 5
    assert calm.forecast(7.5) < 20 < alert.forecast(7.5)
    high = feed([80.0, 81.0, 79.0, 80.5, 79.5, 80.0], surge, 8.0)
    assert high.update(92.0, surge, 8.0).trend < 2  # +15%: not a surge at 80 req/s


def test_after_a_surge_the_trend_is_the_slope_since_it() -> None:
    """A surge's window holds the new slope and the lag the level built before it: taken whole
    as the trend (6 a window here), it would plan a ramp rising 2 a window three times too
    steep for many windows, Holt's constant gain shedding a tenth of each miss. Instead, until
    the gain has its memory's worth of windows (1 / beta), the trend is the least-squares slope
    of the windows since the surge, the level before it first: within three windows it is
    under 3, then it hands back to the filter."""
    surge = HoltGains(alpha=0.4, beta=0.1, surge_sigmas=3.0)
    state = feed([8.0, 8.5, 7.6, 8.2, 7.9, 8.1], surge, 0.8).update(14.0, surge, 0.8)
    assert state.trend > 5 and state.fresh == (pytest.approx(8.04, abs=0.05), 14.0)
    trends = []
    for v in (16.0, 18.0, 20.0, 22.0):
        state = state.update(v, surge, 0.8)
        trends.append(state.trend)
    assert trends[0] < 4.5 and trends[2] < 3.0 and trends[-1] < trends[0]
    for v in range(24, 36, 2):
        state = state.update(float(v), surge, 0.8)
    assert state.fresh == () and state.trend == pytest.approx(2.0, abs=0.3)


def test_gains_outside_the_stable_region_are_refused() -> None:
    for alpha, beta in ((0.0, 0.1), (2.0, 0.1), (0.5, 3.5), (0.5, 0.0)):
        with pytest.raises(ValueError, match="stable region"):
            HoltGains(alpha=alpha, beta=beta)
    with pytest.raises(ValueError, match="var_gain"):
        HoltGains(var_gain=0.0)
