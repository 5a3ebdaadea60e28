"""The simulated engine at one constant rate, summarised as perf/planner_calibrate.py records the
real stack: per-request TTFT and mean ITL (TPOT), their mean, p50 and p90. The calibration test
(tests/unit/test_planner_calibration.py) compares these with the recorded real figures, so the
simulator cannot drift from the engine it stands for.

Against a real run, the simulator replays that run's own arrival times: 90 s at under 1 req/s
is 12-74 requests, and which of them happen to meet (three within 0.1 s, say) moves their mean
TTFT by more than the engine model is to be held to. A long Poisson run says what the rate gives
on average."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import RateSchedule, SimConfig
from pdserve.services.control.planner.sim_workers import SimRequest
from pdserve.services.control.planner.simulate import simulate
from pdserve.services.control.planner.workload import SLO, Workload


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "mean": statistics.fmean(v),
        "p50": v[(len(v) - 1) // 2],
        "p90": v[min(len(v) - 1, math.ceil(0.9 * len(v)) - 1)],
    }


def simulate_requests(
    profile: Profile,
    rate: float,
    isl: int,
    osl: int,
    *,
    duration_s: float = 2000.0,
    arrivals: Sequence[float] = (),
    prefill: int = 1,
    decode: int = 1,
    seed: int = 0,
) -> list[SimRequest]:
    """The finished requests, in arrival order, of a fixed fleet (1P1D: ``pdserve up``'s default)
    at ``rate`` req/s of ISL/OSL-token requests for ``duration_s`` (long, so that the simulated
    figures carry little noise of their own), or at the ``arrivals`` given (seconds from the
    start, ascending: a real run's)."""
    if arrivals:
        duration_s = float(arrivals[-1]) + 1e-6
    result = simulate(
        profile,
        Workload(request_rate=rate, isl=isl, osl=osl),
        RateSchedule.constant(rate, duration_s),
        SLO(1e9, 1e9, "p90"),
        config=SimConfig(
            prefill=prefill, decode=decode, seed=seed, arrivals=tuple(map(float, arrivals))
        ),
    )
    return sorted((r for r in result.requests if r.done == r.done), key=lambda r: r.index)


def simulate_rate(profile: Profile, rate: float, isl: int, osl: int, **run: Any) -> dict[str, Any]:
    """``simulate_requests``' run summarised: the count, TTFT's and ITL's mean, p50 and p90."""
    done = simulate_requests(profile, rate, isl, osl, **run)
    return {
        "requests": len(done),
        "ttft_ms": _stats([r.ttft_ms for r in done]),
        "itl_ms": _stats([r.itl_ms for r in done]),
    }


# The probe workload: three requests alone, then four at once while the third's prompt is in
# progress. The lone ones see the engine as ``pdserve plan`` profiled it; the four wait for one
# prefill step together, decode as a batch of four, and run one role beside the other on the
# host's shared cores and memory, as a loaded stack does. (Four arriving at an idle worker would
# be one step or two, by which of them the engine saw first: the stack did either.)
PROBE_TRACE: tuple[float, ...] = (0.0, 3.5, 7.0, 7.2, 7.2, 7.2, 7.2)


def probe_factors(
    profile: Profile, probes: Sequence[dict[str, Any]], isl: int, osl: int
) -> dict[str, float]:
    """How much slower than the simulator the stack served the probe workload: per probe, the
    real requests' mean TTFT and mean ITL over the simulator's for the same arrivals on
    ``profile``; averaged over ``probes`` (each: ``arrivals_s`` and the per-request
    ``ttft_ms`` and ``itl_ms`` lists). ``profile.scaled(**factors)`` is the profile corrected
    to the stack's speed then, as the live planner's corrections learn it from a window."""
    ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
    for probe in probes:
        sim = simulate_rate(profile, 1.0, isl, osl, arrivals=probe["arrivals_s"])
        if sim["requests"] != len(probe["ttft_ms"]):
            raise ValueError("a probe's requests and arrivals disagree")
        ratios["prefill"].append(statistics.fmean(probe["ttft_ms"]) / sim["ttft_ms"]["mean"])
        ratios["decode"].append(statistics.fmean(probe["itl_ms"]) / sim["itl_ms"]["mean"])
    return {role: statistics.fmean(values) for role, values in ratios.items()}
