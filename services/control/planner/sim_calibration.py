"""The simulated engine at one constant rate, summarised as perf/planner_calibrate.py records the
real stack: per-request TTFT and mean ITL (TPOT), their mean, p50 and p90. The calibration test
(tests/unit/test_planner_calibration.py) compares these with the recorded real figures, so the
simulator cannot drift from the engine it stands for."""

from __future__ import annotations

import math
import statistics
from typing import Any

from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import RateSchedule, SimConfig
from pdserve.services.control.planner.simulate import simulate
from pdserve.services.control.planner.workload import SLO, Workload


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "mean": statistics.fmean(v),
        "p50": v[(len(v) - 1) // 2],
        "p90": v[min(len(v) - 1, math.ceil(0.9 * len(v)) - 1)],
    }


def simulate_rate(
    profile: Profile,
    rate: float,
    isl: int,
    osl: int,
    *,
    duration_s: float = 2000.0,
    prefill: int = 1,
    decode: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """A fixed fleet (1P1D: ``pdserve up``'s default) at ``rate`` req/s of ISL/OSL-token requests
    for ``duration_s`` (long, so that the simulated figures carry little noise of their own)."""
    result = simulate(
        profile,
        Workload(request_rate=rate, isl=isl, osl=osl),
        RateSchedule.constant(rate, duration_s),
        SLO(1e9, 1e9, "p90"),
        config=SimConfig(prefill=prefill, decode=decode, seed=seed),
    )
    done = [r for r in result.requests if r.done == r.done]
    return {
        "requests": len(done),
        "ttft_ms": _stats([r.ttft_ms for r in done]),
        "itl_ms": _stats([r.itl_ms for r in done]),
    }
