"""Smoke run of perf/planner_bench.py's simulated half (the 8-GPU ramp, shortened): the three
fleets go through the ramp, the planner acts within the budget, the advisor's fixed P:D for the
peak meets the SLO where 1P1D does not, and the JSON and the plot are written. The CPU half
starts real stacks for minutes; perf/README.md records its run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_planner_bench_sim_mode_compares_autoscale_with_fixed_fleets(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "perf.planner_bench",
            "--mode",
            "sim",
            "--sim-duration",
            "300",
            "--json",
            str(out),
            "--plot-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = json.loads(out.read_text())["sim_8gpu"]
    auto, one, best = sim["rows"]
    assert auto["config"] == "autoscale" and one["config"] == "fixed 1P1D"
    assert best["config"].startswith("fixed ") and best["config"].endswith("(advisor)")
    # the planner moved, and never past the 8-GPU budget
    assert auto["scaling_actions"] > 0 and 2 < auto["max_workers"] <= 8
    assert max(p["prefill"] + p["decode"] for p in auto["timeline"]) <= 8
    # fixed fleets never move; the peak's advice holds the SLO, 1P1D cannot
    assert one["scaling_actions"] == best["scaling_actions"] == 0
    assert best["attainment"] >= 0.9 > one["attainment"]
    assert auto["attainment"] > one["attainment"]
    assert set(auto["by_phase"]) == {"low", "rise", "peak", "fall", "low again"}
    assert (tmp_path / "planner_ramp_sim8gpu.png").stat().st_size > 10_000
    assert "| autoscale |" in proc.stdout
