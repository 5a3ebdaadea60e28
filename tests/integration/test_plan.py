"""``pdserve plan --quick`` for real: the command as a user runs it, profiling the demo model with
a prefill and a decode worker's engine, each in its own process on the CPU share ``pdserve up``
would give it, then printing advice from the profile it saved. The numbers must be positive and
follow the physics: a longer prompt takes longer to prefill, a larger batch does not step faster
(within noise on a shared 2-core machine), and the KV capacity is the one the options size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pdserve.services.control.planner.profile import Profile

NOISE = 0.75  # a neighbour's burst may slow one cell; a physics violation is far larger


def test_plan_quick_profiles_saves_and_advises(tmp_path: Path) -> None:
    profile_path = tmp_path / "profile.json"
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "plan",
        "--quick",
        "--model",
        "demo",
        "--num-kv-blocks",
        "100",
        "--max-num-batched-tokens",
        "1536",
        "--request-rate",
        "2",
        "--isl",
        "200",
        "--osl",
        "40",
        "--ttft-ms",
        "1000",
        "--itl-ms",
        "100",
        "--profile-out",
        str(profile_path),
        "--result-dir",
        str(tmp_path / "results"),
    ]
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "ERROR"}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "closed form:" in out and "recommendation: " in out
    assert "aggregated" in out
    assert f"profile saved: {profile_path}" in out
    assert (tmp_path / "results" / "plan-attainment.png").stat().st_size > 0
    # progress went to stderr, one line per measured point
    assert done.stderr.count("pdserve plan: decode batch") == 3 * 2

    profile = Profile.load(profile_path)
    run = json.loads(profile_path.read_text())["run"]
    assert profile.model.startswith("pdserve-demo")
    assert profile.prefill_lens == (64, 256, 1024)
    assert profile.decode_batches == (1, 2, 4) and profile.decode_contexts == (64, 256)
    assert all(t > 0 for t in profile.prefill_tokens_per_s)
    assert all(itl > 0 for row in profile.decode_itl_ms for itl in row)
    # 100 blocks of 16 tokens, as --num-kv-blocks 100 sizes a decode worker's pool (the profiling
    # pool held the grid, up to 4 x 256 tokens and more)
    assert profile.kv_capacity_tokens == 1600
    # the engine's token budget per step: the simulated prefill worker batches prompts up to it
    assert profile.prefill_batch_tokens == 1536
    # each role ran on its own share of this machine's CPUs, at one torch thread per CPU
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        assert not set(run["prefill_cpus"]) & set(run["decode_cpus"])
        assert run["prefill_threads"] == len(run["prefill_cpus"])
        assert run["decode_threads"] == len(run["decode_cpus"])
        assert run["prefill_cost"] == len(run["prefill_cpus"])

    # prefill: the time of one prompt grows with its length
    seconds = [
        n / t for n, t in zip(profile.prefill_lens, profile.prefill_tokens_per_s, strict=True)
    ]
    assert seconds[-1] > seconds[0]
    assert all(b > NOISE * a for a, b in zip(seconds, seconds[1:], strict=False))
    # decode: a larger batch never steps faster, at any context (neighbours' bursts make single
    # cells of a few milliseconds jitter, so the ends are held to NOISE and the steps to half)
    for c in range(len(profile.decode_contexts)):
        column = [row[c] for row in profile.decode_itl_ms]
        assert column[-1] >= NOISE * column[0], column
        assert all(b > 0.5 * a for a, b in zip(column, column[1:], strict=False)), column

    # the saved profile serves again without profiling
    again = subprocess.run(
        [
            *argv[:3],
            "plan",
            "--profile",
            str(profile_path),
            "--request-rate",
            "1",
            "--isl",
            "100",
            "--osl",
            "20",
            "--ttft-ms",
            "1000",
            "--itl-ms",
            "100",
            "--result-dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "recommendation: " in again.stdout and "profiling" not in again.stderr
