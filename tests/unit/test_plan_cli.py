"""``pdserve plan`` without a model: a profile written here (``--profile FILE``), the arguments
and their PDSERVE_* variables, the advice and the plot it writes, the budget it keeps, the
workload read from a real ``pdserve bench`` records file, each bad input as one line and exit
2, and where profiling would place each role (the launcher's rule)."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.services.control.bench.client import RequestRecord
from pdserve.services.control.bench.metrics import compute_metrics
from pdserve.services.control.bench.results import RunResult, record_lines
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.profile_run import (
    ProfileSettings,
    busy_note,
    cpu_busy,
    load_profile,
    placements,
    save_profile,
)
from pdserve.shared.config import EngineConfig

ROW = re.compile(r"^\s+(\d+P\d+D|agg x\d+)\s+([\d.]+)\s+([\d.]+)%", re.M)


def small_profile() -> Profile:
    """Prefill 1,000 tok/s at any length; decode ITL 20 + 5 (batch - 1) ms at any context."""
    return Profile.from_points(
        [(100, 1000.0), (4000, 1000.0)],
        [(b, c, 20.0 + 5.0 * (b - 1)) for b in (1, 16) for c in (100, 4000)],
        kv_capacity_tokens=100_000,
        model="hand-made",
        hardware="nowhere",
    )


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    save_profile(small_profile(), {"unit": "CPU", "prefill_cost": 1.0, "decode_cost": 1.0}, path)
    return path


def plan(tmp_path: Path, profile: Path | None, *args: str) -> list[str]:
    argv = ["plan", "--result-dir", str(tmp_path / "results"), "--sim-seconds", "60", *args]
    return argv + (["--profile", str(profile)] if profile else [])


WORKLOAD = ("--request-rate", "2", "--isl", "500", "--osl", "50")
SLO = ("--ttft-ms", "2000", "--itl-ms", "60")


def rows(out: str) -> dict[str, tuple[float, float]]:
    """config -> (cost, attainment %) of every simulated row of the report."""
    return {m[1]: (float(m[2]), float(m[3])) for m in ROW.finditer(out)}


def test_advice_from_a_saved_profile_with_its_arithmetic_and_plot(tmp_path, profile_file, capsys):
    assert main(plan(tmp_path, profile_file, *WORKLOAD, *SLO, "--max-cpus", "6")) == 0
    out = capsys.readouterr().out
    # the closed form works from the profile: 2 req/s x 500 tokens / 1,000 tok/s = 1 busy worker
    assert "closed form:" in out and "load 1.00 busy workers" in out
    assert "recommendation: " in out and "aggregated serving" in out
    found = rows(out)
    assert "1P1D" in found and "agg x1" in found
    assert max(cost for cost, _ in found.values()) <= 6  # never past the budget
    assert any(cost == 6 for cost, _ in found.values())  # ... and up to it
    # one prefill worker is saturated by a load of 1: it cannot meet a 2 s TTFT at p99
    assert found["1P1D"][1] < 99.0
    # the closed form and the simulation agree: two prefill workers, one decode worker
    assert "recommendation: 2P1D (3 CPU)" in out
    assert "run it: pdserve up --prefill-workers 2 --decode-workers 1" in out
    plot = tmp_path / "results" / "plan-attainment.png"
    assert f"attainment plot: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "profile saved" not in out  # reused, not measured


def test_costs_and_unit_come_from_the_profile(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    run = {"unit": "GPU", "prefill_cost": 2.0, "decode_cost": 1.0}
    save_profile(small_profile(), run, path)
    assert main(plan(tmp_path, path, *WORKLOAD, *SLO, "--max-gpus", "5")) == 0
    out = capsys.readouterr().out
    assert "a prefill worker costs 2 GPU, a decode worker 1" in out
    for label, (cost, _) in rows(out).items():
        if not label.startswith("agg"):
            p, d = map(int, label[:-1].split("P"))
            assert cost == 2 * p + d <= 5
    assert main(plan(tmp_path, path, *WORKLOAD, *SLO, "--max-cpus", "5")) == 2
    assert "run on GPUs; budget them in GPUs" in capsys.readouterr().err


def test_options_are_read_from_the_environment(tmp_path, profile_file, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_TTFT_MS", "2500")
    monkeypatch.setenv("PDSERVE_ITL_MS", "80")
    monkeypatch.setenv("PDSERVE_PERCENTILE", "p50")
    monkeypatch.setenv("PDSERVE_MAX_CPUS", "4")
    plot = tmp_path / "elsewhere" / "p.png"
    assert main(plan(tmp_path, profile_file, *WORKLOAD, "--plot", str(plot))) == 0
    out = capsys.readouterr().out
    assert "SLO: TTFT <= 2500 ms and ITL <= 80 ms at p50" in out
    assert max(cost for cost, _ in rows(out).values()) <= 4
    assert plot.is_file()
    # a flag beats its variable
    assert main(plan(tmp_path, profile_file, *WORKLOAD, "--ttft-ms", "900")) == 0
    assert "TTFT <= 900 ms" in capsys.readouterr().out


def bench_records(tmp_path: Path) -> Path:
    """20 successful requests 0.25 s apart (4 req/s) and a failed one, by the bench's writer."""
    records = []
    for i in range(20):
        r = RequestRecord(i, 200 + 50 * (i % 4), 64, success=True, start_time=0.25 * i, ttft=0.1)
        r.itl, r.latency, r.usage_tokens = [0.01] * 9, 0.3, 30 + i
        records.append(r)
    records.append(RequestRecord(20, 99_999, 64, success=False, start_time=5.0, error="boom"))
    run = RunResult("pdserve", 4.0, 1.0, None, compute_metrics(records, 5.0), records)
    path = tmp_path / "chat.records.jsonl"
    path.write_text("\n".join(record_lines([run])) + "\n")
    return path


def test_workload_from_bench_records(tmp_path, profile_file, capsys):
    records = bench_records(tmp_path)
    argv = plan(tmp_path, profile_file, "--workload-records", str(records), *SLO)
    assert main(argv) == 0
    # the failed request is left out; the rate is the records' own
    assert "workload: 4 req/s, ISL 275, OSL 40 (mean, 20 samples)" in capsys.readouterr().out
    json_beside = str(tmp_path / "chat.json")  # the bench's .json names its records too
    argv = plan(tmp_path, profile_file, "--workload-records", json_beside, *SLO)
    assert main([*argv, "--request-rate", "1.5"]) == 0
    assert "workload: 1.5 req/s, ISL 275" in capsys.readouterr().out


def _failed_only(tmp_path: Path) -> str:
    path = tmp_path / "failed.records.jsonl"
    r = RequestRecord(0, 100, 64, success=False, error="boom")
    run = RunResult("pdserve", 1.0, 1.0, None, compute_metrics([r], 1.0), [r])
    path.write_text("\n".join(record_lines([run])) + "\n")
    return str(path)


BAD_INPUT = [
    (
        ["--request-rate", "-1", "--isl", "9", "--osl", "9", *SLO],
        "--request-rate must be a positive",
    ),
    (
        ["--request-rate", "0", "--isl", "9", "--osl", "9", *SLO],
        "--request-rate must be a positive",
    ),
    (["--isl", "9", "--osl", "9", *SLO], "--request-rate is required"),
    ([*WORKLOAD[:2], "--osl", "9", *SLO], "--isl is required"),
    ([*WORKLOAD, "--itl-ms", "50"], "--ttft-ms is required"),
    ([*WORKLOAD, "--ttft-ms", "0", "--itl-ms", "50"], "--ttft-ms must be a positive number"),
    ([*WORKLOAD, "--ttft-ms", "100", "--itl-ms", "nan"], "--itl-ms must be a positive number"),
    ([*WORKLOAD, *SLO, "--max-cpus", "2", "--max-gpus", "1"], "give one budget"),
    ([*WORKLOAD, *SLO, "--max-cpus", "-2"], "--max-cpus must be a positive number"),
    ([*WORKLOAD, *SLO, "--max-cpus", "1"], "costs 2 CPU > budget 1"),
    (["--workload-records", "{tmp}/none.records.jsonl", *SLO], "none.records.jsonl: no such file"),
    (["--workload-records", "{records}", "--isl", "5", *SLO], "exclude each other"),
    (["--workload-records", "{failed}", *SLO], "no successful request records"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(tmp_path, profile_file, capsys, args, message):
    subs = {"tmp": str(tmp_path), "records": str(bench_records(tmp_path))}
    subs["failed"] = _failed_only(tmp_path)
    argv = plan(tmp_path, profile_file, *(a.format(**subs) for a in args))
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve plan: "), captured.err
    assert message in lines[0]
    assert "recommendation" not in captured.out
    assert not (tmp_path / "results").exists()  # nothing written for bad input


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), ("{not json", "not a profile JSON file"), ("{}", "not a usable")],
)
def test_a_bad_profile_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert main(plan(tmp_path, path, *WORKLOAD, *SLO)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(path) in err[0]


def test_bad_profiling_lengths_fail_before_any_profiling(tmp_path, capsys, monkeypatch):
    import pdserve.services.control.planner.profile_run as profile_run

    def never(*_a, **_k):
        raise AssertionError("profiled despite bad input")

    monkeypatch.setattr(profile_run, "run_profile", never)
    for flag, value in (("--decode-batches", "0,2"), ("--prefill-lens", "12,x")):
        assert main(plan(tmp_path, None, *WORKLOAD, *SLO, flag, value)) == 2
        assert flag in capsys.readouterr().err


def test_a_saved_profile_reads_back_for_plan_and_for_the_planner(tmp_path):
    path, run = tmp_path / "p.json", {"unit": "CPU", "prefill_cost": 1.0, "threads": [1]}
    save_profile(small_profile(), run, path)
    assert load_profile(path) == (small_profile(), run)
    assert Profile.load(path) == small_profile()  # what pdserve up --autoscale reads
    assert json.loads(path.read_text())["run"] == run


def test_roles_are_placed_as_pdserve_up_places_its_1p1d():
    two = placements(EngineConfig(model="demo"), [0, 1], [], on_gpu=False)
    assert (two["prefill"].cpus, two["decode"].cpus) == ([0], [1])
    assert two["prefill"].torch_threads == 0  # the worker sizes its pool to its share
    assert two["prefill"].cost == two["decode"].cost == 1.0
    # one CPU: both share it, a thread each (launcher._plan_cpus), half a CPU each
    one = placements(EngineConfig(model="demo"), [0], [], on_gpu=False)
    assert one["decode"].cpus is None and one["decode"].torch_threads == 1
    assert one["decode"].cost == 0.5
    odd = placements(EngineConfig(model="demo"), list(range(5)), [], on_gpu=False)
    assert (odd["prefill"].cpus, odd["decode"].cpus) == ([0, 1, 2], [3, 4])  # prefill first
    tp2 = EngineConfig(model="demo", tensor_parallel_size=2)
    gpu = placements(tp2, list(range(16)), ["0", "1", "2", "3"], on_gpu=True)
    assert (gpu["prefill"].gpus, gpu["decode"].gpus) == ("0,1", "2,3")
    assert gpu["prefill"].cost == gpu["decode"].cost == 2.0


def test_profile_settings_keep_to_the_engine_batch_cap():
    cpu = ProfileSettings.default(quick=False, gpu=False)
    assert cpu.capped(64).decode_batches == cpu.decode_batches
    assert cpu.capped(6).decode_batches == (1, 2, 4, 6)  # the cap itself is measured
    assert cpu.capped(4).decode_batches == (1, 2, 4)


def test_a_busy_machine_is_named_in_the_profile():
    assert busy_note(0.1, 2) == "" and busy_note(None, 2) == ""
    note = busy_note(0.8, 2)
    assert "80% of 2 CPUs in use" in note and "slow" in note
    # a real reading of this machine: a share, and a CPU spinning here makes it busier
    cpus = sorted(os.sched_getaffinity(0))
    idle = cpu_busy(cpus[:1], 0.3)
    assert idle is not None and 0.0 <= idle <= 1.0
    os.sched_setaffinity(0, cpus[:1])
    try:
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                pass

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            assert cpu_busy(cpus[:1], 0.3) > 0.5
        finally:
            stop.set()
            spinner.join()
    finally:
        os.sched_setaffinity(0, cpus)
