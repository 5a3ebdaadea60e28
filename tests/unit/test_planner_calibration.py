"""The simulated engine at a constant rate (sim_calibration.py, what perf/planner_calibrate.py sets
beside the real stack), model-free on the SmolLM2 CPU profile ``pdserve plan`` took: at a rate
where requests seldom meet, a request's TTFT is the profiled prefill time of its prompt (plus the
KV hand-off) and its ITL the profiled ITL of a batch of one; as the rate rises, queueing and the
decode batch raise both. This holds the simulator to the profile it is driven by; the comparison
with the real stack is perf/planner_calibrate.py's, and a test replays its recorded run: that
run's arrivals through the simulator, driven by the profile taken in that run, against the real
stack's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_calibration import (
    PROBE_TRACE,
    probe_factors,
    simulate_rate,
    simulate_requests,
)

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


def test_a_replayed_trace_arrives_as_recorded_and_its_burst_queues() -> None:
    """The calibration replays a real run's arrival times: the simulator takes exactly those, and
    two prompts arriving together wait on each other as the real ones did."""
    trace = [1.0, 7.0, 7.0, 15.0]
    sim = simulate_rate(PROFILE, 0.2, ISL, OSL, arrivals=trace)
    assert sim["requests"] == len(trace)
    alone = 1000 * PROFILE.prefill_seconds(ISL)
    # the lone ones at the profiled prefill time, the pair later: p50 is a lone one, p90 the pair
    assert sim["ttft_ms"]["p50"] == pytest.approx(alone, rel=0.01)
    assert sim["ttft_ms"]["p90"] > 1.5 * alone
    poisson = simulate_rate(PROFILE, 0.2, ISL, OSL, duration_s=100.0)
    assert poisson["requests"] != len(trace)  # without the trace, the schedule's own draws


# perf/planner_calibrate.py, with the prefill worker's batching modelled (perf/README.md, issue 49)
CALIBRATION = RESULTS / "issue49" / "planner_calibration_smollm2_2cpu.json"


def test_the_simulator_stays_near_the_real_stack_it_was_measured_against() -> None:
    """The recorded run replayed: each rate's very arrivals through the simulator, on the
    profile ``pdserve plan`` took just before it: TTFT, mean and p50, and ITL's mean within 20%
    of the real stack's at every rate (issue 49). The run also recorded the stack's speed around
    each rate (the probe workload, ``probe_factors``), which the replay recomputes as recorded."""
    run = json.loads(CALIBRATION.read_text())
    profile = Profile.from_dict(run["profile"])
    assert profile.prefill_batch_tokens > 0  # the prefill worker batches, as the engine does
    for point in run["points"]:
        factors = probe_factors(profile, point["probes"], ISL, OSL)
        assert factors == pytest.approx(point["factors"])
        sim = simulate_rate(profile, point["rate"], ISL, OSL, arrivals=point["arrivals_s"])
        real = point["real"]
        assert sim["requests"] == real["requests"]
        assert sim["ttft_ms"]["mean"] == pytest.approx(real["ttft_ms"]["mean"], rel=0.20)
        assert sim["ttft_ms"]["p50"] == pytest.approx(real["ttft_ms"]["p50"], rel=0.20)
        assert sim["itl_ms"]["mean"] == pytest.approx(real["itl_ms"]["mean"], rel=0.20)


def test_the_probe_factors_are_the_real_probe_over_the_simulated_one() -> None:
    """A stack that served the probe workload exactly as the simulator does has factors of 1; one
    whose every TTFT and ITL took 1.5x and 1.2x as long has 1.5 and 1.2."""
    done = simulate_requests(PROFILE, 1.0, ISL, OSL, arrivals=PROBE_TRACE)
    assert len(done) == len(PROBE_TRACE)
    probe = {
        "arrivals_s": list(PROBE_TRACE),
        "ttft_ms": [r.ttft_ms for r in done],
        "itl_ms": [r.itl_ms for r in done],
    }
    assert probe_factors(PROFILE, [probe], ISL, OSL) == pytest.approx(
        {"prefill": 1.0, "decode": 1.0}
    )
    slow = {
        **probe,
        "ttft_ms": [1.5 * v for v in probe["ttft_ms"]],
        "itl_ms": [1.2 * v for v in probe["itl_ms"]],
    }
    assert probe_factors(PROFILE, [probe, slow], ISL, OSL) == pytest.approx(
        {"prefill": 1.25, "decode": 1.1}
    )
    # the burst waits on itself: its TTFTs are not the lone ones'
    assert max(probe["ttft_ms"]) > 2 * min(probe["ttft_ms"])
