"""The simulated engine at a constant rate (sim_calibration.py, what perf/planner_calibrate.py sets
beside the real stack), model-free on the SmolLM2 CPU profile ``pdserve plan`` took: at a rate
where requests seldom meet, a request's TTFT is the profiled prefill time of its prompt (plus the
KV hand-off) and its ITL the profiled ITL of a batch of one; as the rate rises, queueing and the
decode batch raise both. This holds the simulator to the profile it is driven by; the comparison
with the real stack is perf/planner_calibrate.py's, and the last test replays its recorded run:
the simulator driven by the profile taken in that run, against the real stack's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_calibration import simulate_rate

RESULTS = Path(__file__).resolve().parents[2] / "perf" / "results"
PROFILE = Profile.load(RESULTS / "plan_profile_smollm2_2cpu.json")
ISL, OSL = 128, 32


def test_an_idle_stack_serves_at_the_profiled_speed() -> None:
    sim = simulate_rate(PROFILE, 0.02, ISL, OSL, duration_s=20000.0)
    ttft, itl = sim["ttft_ms"], sim["itl_ms"]
    assert ttft["p50"] == pytest.approx(1000 * PROFILE.prefill_seconds(ISL), rel=0.01)
    # a batch of one at the contexts a 128 + 32-token request spans
    lo, hi = PROFILE.decode_itl(1, ISL), PROFILE.decode_itl(1, ISL + OSL)
    assert 0.98 * lo <= itl["p50"] <= 1.1 * hi


def test_queueing_and_batching_raise_the_latencies_with_the_rate() -> None:
    runs = [simulate_rate(PROFILE, r, ISL, OSL) for r in (0.2, 0.5, 0.8)]
    ttfts = [r["ttft_ms"]["mean"] for r in runs]
    itls = [r["itl_ms"]["mean"] for r in runs]
    assert ttfts == sorted(ttfts) and ttfts[-1] > 1.1 * ttfts[0]
    assert itls == sorted(itls) and itls[-1] > 1.1 * itls[0]


# perf/planner_calibrate.py on a quiet VM, after the few-rows stall fix (perf/README.md, issue 49)
CALIBRATION = RESULTS / "issue49" / "planner_calibration_smollm2_2cpu_quiet.json"


def test_the_simulator_stays_near_the_real_stack_it_was_measured_against() -> None:
    """ITL within 20% of the real stack's at every rate. TTFT is not yet: its p50 was
    1.18-1.30x the simulator's (the stack's own hops and a decode worker sharing the memory bus
    explain part of it, perf/README.md), so the bound here holds that gap from growing."""
    run = json.loads(CALIBRATION.read_text())
    profile = Profile.from_dict(run["profile"])
    for point in run["points"]:
        sim, real = simulate_rate(profile, point["rate"], ISL, OSL), point["real"]
        assert sim["itl_ms"]["mean"] == pytest.approx(real["itl_ms"]["mean"], rel=0.2)
        assert sim["ttft_ms"]["p50"] == pytest.approx(real["ttft_ms"]["p50"], rel=0.35)
