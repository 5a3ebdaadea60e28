"""A small forecaster for the planner: Holt's linear trend (double exponential smoothing) in its
error-correction form, with the spread of its errors, so a window's rate, ISL and OSL can be
looked ahead to the moment a worker asked for now would start serving.

One observation per window (the window's mean), one update::

    predicted = level + trend                  (this window, as the last one foresaw it)
    error     = observed - predicted
    level'    = predicted + alpha x error
    trend'    = trend + beta x error
    var'      = (1 - var_gain) x var + var_gain x error^2      (at least ``noise_floor``)

and the forecast ``h`` windows past the last observation is ``level + h x trend``. On a linear
ramp the trend converges to the slope and the error to 0 (no lag, unlike a moving average); on a
constant load the trend decays to 0 geometrically; on noise the level moves by at most ``alpha``
of each error and the trend by ``beta``, so the state stays bounded by the noise.

The forecast's standard error ``h`` windows ahead is measured, not assumed: the filter keeps its
last states, and each observation scores the forecasts they made of it, 1, 2, ... windows ahead.
A forecast is used to plan capacity, so it is scored as planned: never below its level (a falling
trend is not planned ahead), and only its misses *above* count (a load under the plan costs no
request), doubled to the variance a symmetric error would have. Each horizon's squared misses are
averaged as the one-window errors are. Beyond the horizons scored so far the error grows as in
the ETS(A,A,N) model this update is the filter of (Hyndman and Athanasopoulos, *Forecasting:
Principles and Practice*, table 7.8)::

    var_h = var x (1 + (h - 1) x (alpha^2 + alpha beta h + beta^2 h (2h - 1) / 6))

(with ``beta`` the gain on the error, not Holt's beta* = beta / alpha). That model lets the trend
wander by ``beta`` of every error, so at long horizons it overstates the error of a steady load;
the measured one stays near the noise there, grows at once when a surge beats the forecasts,
and not when a corner makes them overshoot.

**After a surge** (an error beyond ``surge_sigmas`` and ``surge_share``) the level and trend take
all of it at once, but that one window's error is the new slope *plus* the lag the level built
before the filter saw the rise: taken whole as the trend it plans a gentle ramp two or three
times too steep, and Holt's constant gain sheds only ``beta`` of each miss. So until the filter
has ``1 / beta`` windows since the surge (its trend's memory), the trend is the least-squares
slope of those windows, the level before the surge first: on a ramp it is near the slope within
three windows, on a step it decays to 0 as the flat windows accumulate.

Pure: a frozen state in, a new one out, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HoltGains:
    alpha: float = 0.8  # how much of an error the level takes at once
    beta: float = 0.4  # ... and the trend (per window)
    var_gain: float = 0.3  # how fast the error variance forgets
    # an error above the forecast by more than this many standard errors and this share of
    # the forecast is a surge starting: the level and trend take all of it at once (0: never).
    # Both, since at a high rate a few standard errors are a small change
    surge_sigmas: float = 0.0
    surge_share: float = 0.25

    def __post_init__(self) -> None:
        # the stability region of the error-correction form (its forecasts do not diverge)
        if not (0 < self.alpha < 2 and 0 < self.beta < 4 - 2 * self.alpha):
            raise ValueError(f"Holt gains outside the stable region: {self}")
        if not 0 < self.var_gain <= 1:
            raise ValueError("var_gain must be in (0, 1]")


MEMORY = 16  # horizons scored, in windows


@dataclass(frozen=True)
class Holt:
    """The filter's state after ``n`` observations (``n == 0``: nothing seen yet)."""

    level: float = 0.0
    trend: float = 0.0  # per window
    var: float = 0.0  # one-window-ahead error variance
    n: int = 0
    past: tuple[tuple[float, float], ...] = ()  # (level, trend) after each recent observation
    var_ahead: tuple[float, ...] = ()  # [j - 1]: twice the mean squared miss above, j ahead
    # since the last surge: the level before it, then each observation (empty: no fresh surge)
    fresh: tuple[float, ...] = ()

    def update(self, observed: float, gains: HoltGains, noise_floor: float = 0.0) -> Holt:
        """The state after one more window. The first observation sets the level; the error
        variances never drop below ``noise_floor`` (e.g. a Poisson rate's own variance, which
        a handful of calm windows would otherwise talk down to 0)."""
        if self.n == 0:
            return Holt(level=observed, var=noise_floor, n=1, past=((observed, 0.0),))
        predicted = self.level + self.trend
        error = observed - predicted
        g = gains.var_gain
        var = max(noise_floor, (1 - g) * self.var + g * error * error)
        ahead = list(self.var_ahead)
        for j, (level, trend) in enumerate(reversed(self.past), start=1):
            above = max(0.0, observed - max(level, level + j * trend))
            score = 2 * above * above
            if j > len(ahead):
                ahead.append(score)
            ahead[j - 1] = max(noise_floor, (1 - g) * ahead[j - 1] + g * score)
        alpha, beta = gains.alpha, gains.beta
        surge = error > gains.surge_share * abs(predicted)
        fresh = (*self.fresh, observed) if self.fresh else ()
        if gains.surge_sigmas and surge and error * error > gains.surge_sigmas**2 * self.var:
            alpha, beta = 1.0, 1.0
            fresh = (self.level, observed)
        level = predicted + alpha * error
        trend = self.trend + beta * error
        if len(fresh) > 2:
            # a surge's first window is all the filter has of the new slope, and it holds the
            # lag the level built before it too (the error is slope plus catch-up): until the
            # constant gain has as much history as its memory (1 / beta windows), the trend is
            # the least-squares slope of the windows since the surge, the level before it first
            trend = _slope(fresh)
            if len(fresh) > 1 + 1 / beta:
                fresh = ()
        return Holt(
            level=level,
            trend=trend,
            var=var,
            n=self.n + 1,
            past=(*self.past, (level, trend))[-MEMORY:],
            var_ahead=tuple(ahead),
            fresh=fresh,
        )

    def forecast(self, windows_ahead: float) -> float:
        """The value ``windows_ahead`` windows past the last observation (0: its smoothed
        value), never below 0 (rates and lengths are not negative)."""
        return max(0.0, self.level + windows_ahead * self.trend)

    def model_stderr(self, windows_ahead: float, gains: HoltGains) -> float:
        """The ETS(A,A,N) model's standard error ``windows_ahead`` windows on (see the module)."""
        h = max(1.0, windows_ahead)
        a, b = gains.alpha, gains.beta
        growth = 1 + (h - 1) * (a * a + a * b * h + b * b * h * (2 * h - 1) / 6)
        return math.sqrt(self.var * growth)

    def stderr(self, windows_ahead: float, gains: HoltGains) -> float:
        """The standard error of ``forecast(windows_ahead)`` as planned (see the module): the
        measured one at the horizon (rounded up to a whole window; beyond the horizons scored so
        far, the longest one grown as the model grows it), the one-window error before any."""
        j = min(MEMORY, max(1, math.ceil(windows_ahead - 1e-9)))
        scored = min(j, len(self.var_ahead))
        if scored == 0:
            return math.sqrt(self.var)
        var = self.var_ahead[scored - 1]
        if scored < j:
            var *= (self.model_stderr(j, gains) / self.model_stderr(scored, gains)) ** 2
        return math.sqrt(var)


def _slope(values: tuple[float, ...]) -> float:
    """The least-squares slope of evenly spaced values (one a window)."""
    n = len(values)
    mid = (n - 1) / 2
    mean = sum(values) / n
    num = sum((k - mid) * (v - mean) for k, v in enumerate(values))
    return num / sum((k - mid) ** 2 for k in range(n))
