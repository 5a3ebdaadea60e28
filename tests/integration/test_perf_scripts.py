"""Smoke runs of the perf scripts (kv_bench, kv_checksum_bench, load_test, engine_bench,
stack_bench, tp_bench, roofline_bench, step_rows_bench) at toy sizes (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from perf.load_test import ProcessMemory, Report, StreamResult, Wave, judge

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_kv_bench_pulls_and_compares_both_patterns(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    proc = run_module(
        "perf.kv_bench",
        "--sizes-mib",
        "2",
        "--reps",
        "2",
        "--warmup",
        "0",
        "--json",
        str(out),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = {c["pattern"]: c for c in report["cases"]}
    assert set(cases) == {"contiguous", "fragmented"}
    block = report["block_bytes"]
    for case in cases.values():
        assert case["num_bytes"] == case["num_blocks"] * block == 2 << 20
        assert len(case["pull_seconds"]) == len(case["raw_seconds"]) == 2
        assert case["ratio"] == case["raw_median_s"] / case["pull_median_s"] > 0
    assert cases["contiguous"]["messages"] == 1
    assert cases["fragmented"]["messages"] == cases["fragmented"]["num_blocks"]
    assert "| 2 MiB | fragmented |" in proc.stdout


def test_load_test_bounds_admission_and_leaves_no_blocks(tmp_path: Path) -> None:
    out, md = tmp_path / "load.json", tmp_path / "load.md"
    proc = run_module(
        "perf.load_test",
        "--streams",
        "12",
        "--waves",
        "2",
        "--max-queue",
        "2",
        "--max-tokens",
        "4",
        "--timeout",
        "60",
        "--json",
        str(out),
        "--md",
        str(md),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["violations"] == []
    outcomes = report["outcomes"]
    assert outcomes.get("completed", 0) > 0 and outcomes.get("rejected_503", 0) > 0
    assert outcomes["completed"] + outcomes["rejected_503"] == 24
    assert len(report["wave_log"]) == 2
    for wave in report["wave_log"]:
        assert sum(wave["outcomes"].values()) == 12
        assert len(wave["used_blocks_after"]) == 2
        assert set(wave["used_blocks_after"].values()) == {0}
    assert {m["name"] for m in report["memory"]} == {"gateway", "prefill", "decode"}
    assert all(len(m["rss_after_wave_mib"]) == 2 for m in report["memory"])
    assert "**Verdict:** PASS" in md.read_text()


def test_load_test_judges_hangs_errors_and_leaks_as_violations() -> None:
    report = Report(streams=3, waves=1, max_queue=1, max_tokens=4, request_timeout=1.0)
    leaky = Wave(
        used_blocks_after={"decode-0": 3.0, "prefill-0": 0.0},
        in_flight_after=1.0,
        settle_seconds=60.0,
    )
    report.wave_log = [leaky]
    results = [
        StreamResult(0, outcome="completed", finish_reason="length", seconds=0.1),
        StreamResult(1, outcome="timeout"),
        StreamResult(2, outcome="error", detail="stream ended without [DONE]"),
    ]
    leaky_gateway = ProcessMemory("gateway", 1, 50.0, 60.0, 60.0, [52.0, 54.0, 56.0, 58.0, 60.0])
    steady_worker = ProcessMemory(
        "decode", 2, 900.0, 990.0, 980.0, [970.0, 985.0, 980.0, 981.0, 980.0]
    )
    report.memory = [leaky_gateway, steady_worker]
    judge(report, results, workers=2, rss_growth_limit=100.0, leak_limit_kib=2.0)
    text = "\n".join(report.violations)
    assert "1 streams ended as timeout" in text
    assert "1 streams ended as error" in text
    assert "decode-0 still holds 3 KV blocks" in text
    assert "1 requests in flight" in text
    assert [s.index for s in report.samples] == [1, 2]
    # 2 MiB per 3-request wave over waves 3..5: a steady leak; the worker's warm-up step is not
    assert "gateway RSS keeps growing: 682.7 KiB per request" in text
    assert "decode RSS" not in text


def test_engine_and_stack_benches_compare_against_hf(tmp_path: Path) -> None:
    """Toy sizes: the engine bench and the whole-stack bench (real ``pdserve up`` 1P1D and
    aggregated) run, serve every requested token and report ratios against HF."""
    toy = ["--requests", "3", "--layers", "1", "--hidden", "64", "--vocab", "300"]
    engine_out, stack_out = tmp_path / "engine.json", tmp_path / "stack.json"
    proc = run_module("perf.engine_bench", *toy, "--json", str(engine_out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = json.loads(engine_out.read_text())
    assert engine["speedup"] > 0 and engine["ceiling_speedup"] > 0 and engine["batch1"] is None
    proc = run_module("perf.stack_bench", *toy, "--json", str(stack_out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stack = json.loads(stack_out.read_text())
    assert [s["prefill_workers"] for s in stack["stacks"]] == [1, 0]
    assert all(s["vs_hf"] > 0 for s in stack["stacks"])
    assert stack["output_tokens"] == engine["output_tokens"]


def test_request_path_counts_the_modules_each_process_runs() -> None:
    """perf/request_path.py, the measure of issue 27, on the demo model: each process reports
    the modules of its own role, and none of another's."""
    proc = run_module("perf.request_path", "--model", "demo", "--max-tokens", "4", timeout=300)
    out = proc.stdout
    roles = {line.split(":")[0] for line in out.splitlines() if line.endswith(" modules")}
    assert {"gateway", "prefill", "decode"} <= roles, out
    section = out.split("gateway:")[1].split("\n", 1)[1].split(":")[0]
    assert "gateway/inflight/bus_request.py" in section and "services/" not in section, out
    assert "services/engine/scheduler.py" in out.split("decode:")[1], out
    assert "one streamed disaggregated chat request" in out, out


def test_tp_bench_compares_tp2_with_tp1_and_pulls_every_layout(tmp_path: Path) -> None:
    """perf/tp_bench.py, the measure of issue 28, on the demo model (4 heads, 2 KV heads): both
    modes decode every token, TP 2 counts its all-reduces, and the KV bytes measured over UCX
    equal the ones computed from the layout."""
    out = tmp_path / "tp.json"
    proc = run_module(
        "perf.tp_bench",
        "--model",
        "demo",
        "--reps",
        "1",
        "--batches",
        "1",
        "2",
        "--batch1-prompts",
        "1",
        "--prompt-tokens",
        "16",
        "--max-tokens",
        "4",
        "--kv-tokens",
        "40",
        "--kv-reps",
        "1",
        "--json",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["note"] is None  # the demo model splits as it is
    assert [c["batch"] for c in report["decode"]] == [1, 2]
    for case in report["decode"]:
        tp1, tp2 = case["modes"]["TP 1 x 2 threads"], case["modes"]["TP 2 x 1 thread"]
        assert tp1["tokens"] == tp2["tokens"] == case["prompts"] * 3  # 4 tokens, 1 prefilled
        assert tp1["reduce_ms_per_step"] is None
        assert tp2["reduce_calls_per_step"] == 2 * report["model_config"]["num_layers"]
        assert 0 < tp2["reduce_share"] < 1
        assert case["tp2_over_tp1"] > 0
    kv = {(c["prefill_tp"], c["decode_tp"]): c for c in report["kv"]}
    assert set(kv) == {(2, 1), (1, 2), (2, 2), (1, 1)}
    for case in kv.values():
        assert case["measured_bytes"] == case["computed_bytes"]
        assert case["blocks"] == 3 and case["pull_ms"] > 0
    whole = kv[1, 1]["computed_bytes"][0]
    assert kv[2, 1]["computed_bytes"] == [whole] and kv[2, 1]["pieces"] == [2]
    assert kv[1, 2]["computed_bytes"] == kv[2, 2]["computed_bytes"] == [whole // 2] * 2
    assert "| 40 | 2 -> 1 |" in proc.stdout


def test_kv_checksum_bench_pulls_with_the_check_on_and_off(tmp_path: Path) -> None:
    out = tmp_path / "sums.json"
    proc = run_module(
        "perf.kv_checksum_bench", "--sizes-mib", "1", "--reps", "2", "--json", str(out), timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    (case,) = json.loads(out.read_text())["cases"]
    assert case["blocks"] == 2 and case["off_gbps"] > 0 and case["on_gbps"] > 0
    assert case["verify_ms"] > 0 and case["lease_hash_gbps"] > 0


def test_roofline_bench_reads_each_pass_against_both_peaks(tmp_path: Path) -> None:
    """perf/roofline_bench.py (issue 34) on a tiny random-weight Llama: the peaks before and
    after, the roof their maximum, each case's passes counted as the engine counted them (a
    prefill of 64 tokens: the analytic FLOPs), and the plot."""
    from pdserve.shared.telemetry.roofline import ModelCost, ModelShape, Storage, step_shape
    from perf.roofline_bench import RANDOM_SHAPES

    out, png = tmp_path / "roof.json", tmp_path / "roof.png"
    proc = run_module(
        "perf.roofline_bench",
        "--random-shape",
        "tiny",
        "--reps",
        "2",
        "--quick-peaks",
        "--batches",
        "1",
        "4",
        "--int8-batches",
        "1",
        "--prefill-lens",
        "64",
        "--steps",
        "3",
        "--json",
        str(out),
        "--plot",
        str(png),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    before, after, roof = (doc["peaks"][k] for k in ("before", "after", "roof"))
    assert roof["flops_per_s"] == max(before["flops_per_s"], after["flops_per_s"])
    assert roof["bytes_per_s"] == max(before["bytes_per_s"], after["bytes_per_s"])
    cases = {c["name"]: c for c in doc["cases"]}
    assert list(cases) == ["decode b1", "decode b4", "decode b1 int8", "prefill 64"]
    for c in cases.values():
        assert len(c["rounds"]) == 2
        assert all(r["steps"] == (3 if c["phase"] == "decode" else 1) for r in c["rounds"])
        r = c["result"]
        assert r["bound"] in ("compute", "memory") and r["advice"].startswith(c["phase"])
        assert r["bandwidth_fraction"] == r["bytes_per_s"] / roof["bytes_per_s"]
    # INT8 weights move fewer bytes for the same FLOPs
    b1, b1_int8 = cases["decode b1"]["rounds"][0], cases["decode b1 int8"]["rounds"][0]
    assert b1_int8["flops"] == b1["flops"] and b1_int8["bytes"] < b1["bytes"] / 2
    s = RANDOM_SHAPES["tiny"]
    shape = ModelShape(
        s["num_hidden_layers"],
        s["hidden_size"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
        s["head_dim"],
        s["intermediate_size"],
        s["vocab_size"],
    )
    prefill = ModelCost(shape, Storage(0, 0, 0, 0)).cost(step_shape([64], [0], 0, False, 1, 1))
    assert cases["prefill 64"]["rounds"][1]["flops"] == prefill.flops
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 20_000
    # before and after: an earlier report's cases hollow, an arrow to each case now
    halved = json.loads(out.read_text())
    for c in halved["cases"]:
        c["result"]["flops_per_s"] /= 2
    (tmp_path / "before.json").write_text(json.dumps(halved))
    both = tmp_path / "both.png"
    proc = run_module(
        "perf.roofline_plot", str(out), str(both), str(tmp_path / "before.json"), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert both.stat().st_size > png.stat().st_size  # the extra points and arrows


def test_step_rows_bench_prices_each_row_count(tmp_path: Path, checkpoints) -> None:
    """perf/step_rows_bench.py (issue 42) on a tiny float32 checkpoint: one verification step
    per row count through the engine's default path, priced against the first; float32 steps of
    1-24 rows take the C++ decoder where the extension builds."""
    from pdserve.kernels import cpu_gemv

    out = tmp_path / "rows.json"
    proc = run_module(
        "perf.step_rows_bench",
        "--model",
        str(checkpoints["llama-gqa"]),
        "--rows",
        "1",
        "5",
        "--reps",
        "2",
        "--context",
        "20",
        "--json",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 5]
    assert rows[0]["vs_first"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    assert all(r["fused"] for r in rows) == cpu_gemv.available()
