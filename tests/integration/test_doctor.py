"""``pdserve doctor`` as a user runs it: a subprocess, locally over tcp/lo, against a real 1P1D
stack, and with bad input (one line, exit 2, never a traceback). Sizes stay at 1 MiB."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.config import BusConfig
from pdserve.shared.kv.ucx_config import interface_addresses
from pdserve.shared.telemetry import peaks
from tests.integration.stack import QUIET_ENV, free_port, start_nats, start_service, stop_all

ROOT = Path(__file__).resolve().parents[2]
# the peaks (a ~10 s measurement) have a test of their own
QUICK = ["--sizes-mib", "1", "--reps", "2", "--no-peaks"]


def doctor(*args: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "doctor", *args],
        cwd=ROOT,
        env={**env, **QUIET_ENV, **extra_env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_local_check_reports_transports_and_fails_below_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    proc = doctor(*QUICK, "--min-ratio", "0", "--min-gbps", "1000", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("FAILED: 1 failed") and lines[-1].endswith("-> exit 1")
    assert any(line.startswith("UCX 1.") for line in lines)  # version in the header
    report = json.loads(out.read_text())
    found = checks(report)
    assert found["peer test"]["status"] == "fail" and "--min-gbps 1000" in proc.stdout
    # the lanes UCX chose for the endpoint between the two processes, by message size
    selected = found["selected"]
    assert selected["status"] == "ok" and "ucp_tag_send" in selected["details"][0]
    assert all(len(row.split()) >= 3 for row in selected["details"][1:])
    assert found["RDMA"]["status"] in ("ok", "warn", "fail")  # whatever this host has
    (case,) = report["peer_test"]["cases"]
    assert case["num_bytes"] == 1 << 20 and case["pull_gbps"] > 0 and case["raw_gbps"] > 0
    assert report["peer_test"]["ucx"]["resources"]


def test_peaks_are_measured_in_full_reported_and_cached_for_the_workers(tmp_path: Path) -> None:
    """A worker at one torch thread on this CPU in fp32 finds the doctor's full measurement in
    the cache (and a quick one of its own cannot replace it)."""
    out, cache = tmp_path / "doctor.json", tmp_path / "cache"
    args = ["--no-peer-test", "--device", "cpu", "--torch-threads", "1", "--json", str(out)]
    proc = doctor(*args, timeout=180, PDSERVE_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[ OK ] peaks"))
    assert ", 1 thread, float32: " in line and "GFLOP/s" in line and "GB/s read" in line, line
    assert "ridge" in line and "full measurement in" in proc.stdout
    (found,) = json.loads(out.read_text())["peaks"]
    assert found["quick"] is False and found["threads"] == 1 and found["gemm_n"] >= 1024
    assert 1e8 < found["flops_per_s"] < 1e16 and 1e8 < found["bytes_per_s"] < 1e13
    key = peaks.cache_key("cpu", "float32", 1)
    held = peaks.read_cached(key, cache / "peaks")
    assert held is not None and held[1] is False and held[0].flops_per_s == found["flops_per_s"]
    assert Path(found["cache"]) == peaks.cache_path(key, cache / "peaks")
    assert peaks.load_or_measure("cpu", "float32", 1, cache / "peaks") == held[0]
    skipped = doctor("--no-peer-test", "--no-peaks", timeout=60, PDSERVE_CACHE_DIR=str(cache))
    assert "[INFO] peaks" in skipped.stdout and "skipped (--no-peaks)" in skipped.stdout


def test_unreachable_nats_is_one_line_and_exit_2() -> None:
    proc = doctor("--nats-url", f"nats://127.0.0.1:{free_port()}", timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("pdserve doctor: cannot reach NATS at nats://127.0.0.1:")


def test_ucx_host_not_on_this_machine_is_one_line_and_exit_2() -> None:
    host = "203.0.113.77"  # TEST-NET-3: never a real interface
    assert host not in interface_addresses().values()
    proc = doctor("--ucx-host", host, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert (
        line.startswith("pdserve doctor: --ucx-host") and "not an address of this machine" in line
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--torch-threads", "-1"], "--torch-threads must be 0 or more"),
        (["--device", "tpu"], "--device 'tpu': auto, cpu or cuda[:N]"),
    ],
)
def test_nonsense_peaks_options_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    proc = doctor("--no-peer-test", *args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"pdserve doctor: {says}"


async def loads(url: str, want: set[str], until, timeout: float = 60) -> dict[str, WorkerLoad]:
    """The latest heartbeat of each worker in ``want``, once ``until(loads)`` holds."""
    bus = Bus(BusConfig(nats_url=url), "doctor-test")
    await bus.connect()
    seen: dict[str, WorkerLoad] = {}

    async def on_load(msg: WorkerLoad, headers) -> None:
        seen[msg.worker_id] = msg

    await bus.subscribe(bus.subjects.all_loads, on_load, (WorkerLoad,))
    try:
        async with asyncio.timeout(timeout):
            while not (want <= set(seen) and until(seen)):
                await asyncio.sleep(0.1)
    finally:
        await bus.close()
    return seen


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("doctor-stack")
    nats = start_nats(logs)
    opts = {"model": "demo", "num_kv_blocks": 16, "heartbeat_seconds": 0.25}
    children = [
        start_service("prefill", nats.url, logs, None, {**opts, "worker_id": "p0"}),
        start_service("decode", nats.url, logs, None, {**opts, "worker_id": "d0"}),
    ]
    yield nats, children
    stop_all(children)
    nats.stop()


async def test_running_stack_every_decode_worker_pulls_from_every_prefill_worker(stack) -> None:
    nats, children = stack
    await loads(nats.url, {"p0", "d0"}, lambda seen: True)  # both up
    args = ["--nats-url", nats.url, *QUICK, "--min-ratio", "0", "--discover-seconds", "1"]
    proc = await asyncio.to_thread(doctor, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    text = proc.stdout
    assert "1 prefill, 1 decode worker(s)" in text
    pull = next(line for line in text.splitlines() if "d0 <- p0" in line)
    assert pull.startswith("[ OK ] KV pull") and "bytes verified" in pull, text
    assert "peer test" in text and text.strip().splitlines()[-1].endswith("-> exit 0")
    # the probe's blocks went back on both sides
    await loads(
        nats.url,
        {"p0", "d0"},
        lambda seen: all(ld.free_blocks == ld.total_blocks for ld in seen.values()),
        timeout=10,
    )


def test_a_stack_without_workers_fails(stack) -> None:
    nats, _ = stack
    args = ["--nats-url", nats.url, "--namespace", "nobody-here", "--no-peer-test", "--no-peaks"]
    proc = doctor(*args, "--discover-seconds", "0.5", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[FAIL] stack" in proc.stdout and "no decode worker heard" in proc.stdout


def test_tp_workers_list_each_rank_with_its_pid_and_transports(tmp_path: Path) -> None:
    """Prefill at TP 2, decode at TP 1 (ranks are real processes, each with its own UCX
    endpoint): the probe pulls the heads both rank 0s hold, head-sliced, and checks them."""
    nats = start_nats(tmp_path)
    opts = {"model": "demo", "num_kv_blocks": 16, "heartbeat_seconds": 0.25}
    children = [
        start_service(
            role,
            nats.url,
            tmp_path,
            None,
            {**opts, "worker_id": worker, "tensor_parallel_size": tp},
        )
        for role, worker, tp in (("prefill", "p0", 2), ("decode", "d0", 1))
    ]
    try:
        asyncio.run(loads(nats.url, {"p0", "d0"}, lambda seen: True, timeout=120))
        out = tmp_path / "doctor.json"
        proc = doctor(
            "--nats-url",
            nats.url,
            "--no-peer-test",
            "--no-peaks",
            "--discover-seconds",
            "1",
            "--json",
            str(out),
        )
    finally:
        stop_all(children)
        nats.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = checks(json.loads(out.read_text()))["TP ranks"]
    assert check["status"] == "ok", check
    assert checks(json.loads(out.read_text()))["stack"]["status"] == "ok"  # the probe verified
    for worker, line in zip(("p0",), check["details"], strict=True):
        assert line.startswith(f"{worker}: TP 2 (rank 0 pid ") and "; rank 1 pid " in line
        assert line.count("tcp/lo") == 2, line  # --ucx-host 127.0.0.1: UCX's TCP on lo only
    ranks = json.loads(out.read_text())["tp_ranks"]["p0"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
