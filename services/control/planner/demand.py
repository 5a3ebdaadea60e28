"""The demand a decision sizes for: the window fed to the forecasters (forecast.py), then looked
ahead to the moment a worker asked for now would start serving.

**Horizons.** A window's mean rate is the rate at its middle, half a window ago. What a decision
starts must carry the load until what the next decision starts can serve, one window later. So a
decision looks ``(window / 2 + start + window) / window`` windows past the last observation, with
``start`` the measured start latency: a promotion from the warm pool (``warm``, seconds), or a
model load (``cold``). 60 s starts and 30 s windows look 3.5 windows ahead cold, 1.5 warm.

**Outlooks.** The load at a horizon is the forecast of the rate, ISL and OSL there, but never
below their present level: a falling trend is not planned ahead (a worker removed early cannot be
back in time if the fall stops; scale-down has its own guards in decide.py). The *upper* outlook
adds ``pool_z`` standard errors of the rate forecast: what the warm pool hedges.

**Sizing.** sizing.py's arithmetic on an outlook, with the role's backlog (requests queued at its
workers, spread over one window) on top of the rate, and the corrections of decide.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.services.control.planner.inputs import (
    ROLES,
    MetricsWindow,
    PlannerConfig,
    PlannerState,
)
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sizing import (
    DecodeSizing,
    PrefillSizing,
    size_decode,
    size_prefill,
)
from pdserve.services.control.planner.workload import SLO

Sizing = PrefillSizing | DecodeSizing


@dataclass(frozen=True)
class Horizons:
    warm: float  # windows past the last observation
    cold: float
    warm_s: float  # the start latencies they were computed from
    cold_s: float


def horizons(window: MetricsWindow, config: PlannerConfig) -> Horizons:
    d = window.duration_s
    warm = config.warm_start_s if window.warm_start_s is None else window.warm_start_s
    cold = config.cold_start_s if window.cold_start_s is None else window.cold_start_s
    ahead = lambda start: (d / 2 + start + d) / d  # noqa: E731
    return Horizons(warm=ahead(warm), cold=ahead(cold), warm_s=warm, cold_s=cold)


def observe(window: MetricsWindow, state: PlannerState, config: PlannerConfig) -> PlannerState:
    """The forecasters after this window. The rate is fed every window (zero is a rate), its
    error variance floored at a Poisson count's (rate / window: a calm spell must not make the
    filter trust one window's noise); the lengths only when requests finished (the gateway
    counts tokens at the finish)."""
    rate = window.request_rate
    floor = max(rate, state.rate.level) / window.duration_s if window.duration_s > 0 else 0.0
    updates = {"rate": state.rate.update(rate, config.rate_gains, floor)}
    if window.mean_isl > 0:
        updates["isl"] = state.isl.update(window.mean_isl, config.length_gains)
        updates["osl"] = state.osl.update(max(1.0, window.mean_osl), config.length_gains)
    return dataclasses.replace(state, **updates)


@dataclass(frozen=True)
class Outlook:
    windows_ahead: float
    rate: float  # req/s
    isl: float
    osl: float

    def describe(self) -> str:
        return f"{self.rate:.2f} req/s, ISL {self.isl:.0f}, OSL {self.osl:.0f}"


def outlook(
    state: PlannerState, windows_ahead: float, config: PlannerConfig, z: float = 0.0
) -> Outlook:
    """The load ``windows_ahead`` windows on (never below the present level), the rate raised by
    ``z`` standard errors of its forecast."""
    r = state.rate
    rate = max(r.level, r.forecast(windows_ahead)) + z * r.stderr(windows_ahead, config.rate_gains)
    isl, osl = state.isl, state.osl
    return Outlook(
        windows_ahead=windows_ahead,
        rate=max(0.0, rate),
        isl=max(1.0, isl.level, isl.forecast(windows_ahead)),
        osl=max(1.0, osl.level, osl.forecast(windows_ahead)),
    )


def backlog(window: MetricsWindow) -> dict[str, float]:
    """Per role, the requests queued at its workers as a rate that clears them in one window."""
    return {r: sum(w.queue for w in window.of(r)) / window.duration_s for r in ROLES}


def size(
    role: str,
    load: Outlook,
    extra: float,
    profile: Profile,
    slo: SLO,
    state: PlannerState,
    config: PlannerConfig,
) -> Sizing:
    """One role's sizing for an outlook, its backlog added to the rate."""
    if role == "prefill":
        return size_prefill(
            profile, load.rate + extra, load.isl, slo, state.prefill_correction, config.prefill_cv2
        )
    return size_decode(
        profile,
        load.rate + extra,
        load.isl,
        load.osl,
        slo,
        state.decode_correction,
        config.kv_saturation,
    )
