"""The short form of ``perf/chaos_bench.py`` (#47): 120 s of steady load on 2P2D (the tiny
llama) through an abort storm, a SIGKILL of a prefill and of a decode worker (each restarted), a
NATS node restart, and real network partitions of a decode and of a prefill worker's host for
6 s each (network namespaces; without root or ``ip netns`` the partitions are left out and the
report says why). No request may hang, no completed stream may differ from the undisturbed
run's, no KV block may stay held; the stack serves again after every fault.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost import netns

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_short_chaos_schedule_loses_nothing(tmp_path: Path, llama_dir: Path) -> None:
    out = tmp_path / "chaos.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    proc = subprocess.run(
        [sys.executable, "-m", "perf.chaos_bench", "--duration", "120", "--clients", "3"]
        + ["--outage", "6"]
        + ["--model", str(llama_dir), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests["hung"] == 0, report
    assert report["blocks_leaked"] == 0, report
    assert report["streams_differing_from_reference"] == 0, report
    assert report["tokens_lost"] == report["tokens_duplicated"] == 0, report
    assert requests["completed"] > 10 * requests["error"], report  # errors are the exception
    faults = ["abort_storm", "kill_prefill", "kill_decode", "nats_restart"]
    if netns.unavailable_reason() is None:
        faults += ["partition_decode", "partition_prefill"]
        assert report["partition"].startswith("real:"), report["partition"]
    assert [f["fault"] for f in report["faults"]] == faults
    assert report["unrecovered_faults"] == 0, report
    assert proc.returncode == 0, proc.stderr[-4000:]
