"""`pdserve bench`'s bottleneck section (services/control/bench/bottleneck.py), model-free: a gateway's
/metrics page before and after a run gives each phase's achieved rates, fractions of the peaks,
bound and advice; in the printed summary, the JSON and the markdown; a server without the series
(vLLM) reports nothing."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from pdserve.services.control.bench import bottleneck as bn
from pdserve.services.control.bench.metrics import BenchMetrics, Distribution
from pdserve.services.control.bench.report import write_report
from pdserve.services.control.bench.results import RunResult, load_runs, result_document, write_json
from pdserve.services.control.bench.sweep import print_summary
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.telemetry.metrics import WorkerLoadCollector, render_metrics
from pdserve.shared.telemetry.roofline import Cost, Peaks, advice, roofline


def page(
    p0: tuple[float, float, float],
    d0: tuple[float, float, float],
    d0_prefill: float = 0.0,
    d1: tuple[float, float, float] | None = None,
) -> str:
    """A gateway's page as Prometheus text: prefill worker p0 and decode worker d0 on a device
    of 1 TFLOP/s and 100 GB/s (ridge 10); d1 (if given) on one of 2 TFLOP/s and 400 GB/s."""
    lines = []
    for i, (name, _) in enumerate((("flops", 0), ("bytes", 1), ("busy_seconds", 2))):
        lines += [
            f"# HELP pdserve_step_{name}_total what the forward passes did.",
            f"# TYPE pdserve_step_{name}_total counter",
            f'pdserve_step_{name}_total{{phase="prefill",role="prefill",worker="p0"}} {p0[i]}',
            f'pdserve_step_{name}_total{{phase="decode",role="prefill",worker="p0"}} 0.0',
            f'pdserve_step_{name}_total{{phase="prefill",role="decode",worker="d0"}} '
            f"{d0_prefill if i == 2 else d0_prefill * 1e11}",
            f'pdserve_step_{name}_total{{phase="decode",role="decode",worker="d0"}} {d0[i]}',
        ]
        if d1 is not None:
            lines.append(
                f'pdserve_step_{name}_total{{phase="decode",role="decode",worker="d1"}} {d1[i]}'
            )
    peaks = {"p0": (1e12, 100e9), "d0": (1e12, 100e9), "d1": (2e12, 400e9)}
    for i, name in enumerate(("flops", "bytes")):
        lines += [f"# TYPE pdserve_peak_{name}_per_second gauge"]
        for worker, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
            if worker != "d1" or d1 is not None:
                lines.append(
                    f'pdserve_peak_{name}_per_second{{role="{role}",worker="{worker}"}} '
                    f"{peaks[worker][i]}"
                )
    lines += [
        "# TYPE pdserve_kv_cache_used_blocks gauge",
        'pdserve_kv_cache_used_blocks{role="decode",worker="d0"} 3.0',
    ]
    return "\n".join(lines) + "\n"


# before: what the warm-up did; after: plus 2 s of prefill at 0.4 TFLOP/s (intensity 100) and 4 s
# of decode at 80 GB/s (intensity 2)
BEFORE = page(p0=(1e11, 1e9, 0.5), d0=(1e9, 5e8, 0.01))
AFTER = page(p0=(1e11 + 8e11, 1e9 + 8e9, 2.5), d0=(1e9 + 6.4e11, 5e8 + 3.2e11, 4.01))


def test_each_phase_against_its_roofs() -> None:
    got = bn.bottleneck(bn.parse_roofline(BEFORE), bn.parse_roofline(AFTER))
    assert list(got) == ["prefill", "decode"]
    pre, dec = got["prefill"], got["decode"]
    assert pre.workers == ["p0"] and pre.busy_seconds == pytest.approx(2.0)
    assert pre.flops_per_s == pytest.approx(4e11) and pre.intensity == pytest.approx(100)
    assert pre.compute_fraction == pytest.approx(0.4) and pre.bandwidth_fraction == pytest.approx(
        0.04
    )
    assert pre.bound == "compute" and pre.ridge == pytest.approx(10)
    assert pre.advice.startswith("prefill at 40% of peak compute")
    assert dec.bytes_per_s == pytest.approx(80e9) and dec.intensity == pytest.approx(2)
    assert dec.bandwidth_fraction == pytest.approx(0.8) and dec.bound == "memory"
    assert dec.advice.startswith("decode at 80% of memory bandwidth (memory-bound)")
    assert "INT8" in dec.advice


def test_workers_on_different_devices_weigh_by_their_busy_time() -> None:
    # d1 (400 GB/s) decodes 1 s at 200 GB/s beside d0's 4 s at 80 GB/s: the bytes moved over what
    # the roofs allowed in those seconds, (3.2e11 + 2e11) / (4 x 100e9 + 1 x 400e9) = 0.65
    before = page(p0=(0, 0, 0), d0=(0, 0, 0), d1=(0, 0, 0))
    after = page(p0=(0, 0, 0), d0=(6.4e11, 3.2e11, 4.0), d1=(4e11, 2e11, 1.0))
    dec = bn.bottleneck(bn.parse_roofline(before), bn.parse_roofline(after))["decode"]
    assert dec.workers == ["d0", "d1"] and dec.busy_seconds == pytest.approx(5)
    assert dec.bandwidth_fraction == pytest.approx(0.65)
    assert dec.peak_bytes_per_s == pytest.approx(160e9)  # busy-weighted: (4 x 100 + 400) / 5
    assert "prefill" not in bn.bottleneck(bn.parse_roofline(before), bn.parse_roofline(after))


def test_a_decode_worker_prefilling_locally_counts_in_the_prefill_phase() -> None:
    before = page(p0=(0, 0, 0), d0=(0, 0, 0))
    after = page(p0=(0, 0, 0), d0=(0, 0, 0), d0_prefill=0.5)
    got = bn.bottleneck(bn.parse_roofline(before), bn.parse_roofline(after))
    assert list(got) == ["prefill"] and got["prefill"].workers == ["d0"]


def test_joined_restarted_and_unmeasured_workers() -> None:
    before = bn.parse_roofline(page(p0=(0, 0, 0), d0=(5e11, 2e11, 9.0)))
    # d0 restarted under its id (its counters fell): what it did since counts
    after = bn.parse_roofline(page(p0=(0, 0, 0), d0=(2e11, 1e11, 2.0), d1=(1e11, 1e11, 1.0)))
    assert after is not None and before is not None
    del after.peaks[("d1", "decode")]  # d1 joined during the run and reports no peaks
    dec = bn.bottleneck(before, after)["decode"]
    assert dec.busy_seconds == pytest.approx(3.0) and dec.workers == ["d0", "d1"]
    assert dec.unmeasured_workers == ["d1"]
    assert dec.bandwidth_fraction == pytest.approx(0.5)  # d0 alone: 1e11 B in 2 s of 100 GB/s
    del after.peaks[("d0", "decode")]
    nothing = bn.bottleneck(before, after)["decode"]
    assert nothing.bound is None and nothing.compute_fraction is None and nothing.advice is None
    assert "no peaks reported" in "\n".join(bn.summary_lines(bn.as_dicts({"decode": nothing})))


def test_a_server_without_the_series_reports_nothing() -> None:
    vllm = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
    assert bn.parse_roofline(vllm) is None
    assert bn.summary_lines({}) == [] and bn.markdown([("vllm @ 1 req/s", {})]) == ""


def test_the_names_are_the_gateways_own() -> None:
    """The page a real gateway renders from its workers' heartbeats parses the same way."""
    fields = {
        "decode_flops": 6e11,
        "decode_bytes": 3e11,
        "decode_busy_seconds": 3.0,
        "peak_flops_per_second": 1e12,
        "peak_bytes_per_second": 100e9,
    }
    load = WorkerLoad("d0", "decode", "m", 1, 2, 0, 0, **fields)
    registry = CollectorRegistry()
    registry.register(WorkerLoadCollector(lambda: [load]))
    snap = bn.parse_roofline(render_metrics(registry)[0].decode())
    assert snap is not None
    assert snap.totals[("d0", "decode", "decode")] == (6e11, 3e11, 3.0)
    assert snap.peaks == {("d0", "decode"): (1e12, 100e9)}
    got = bn.bottleneck(bn.Snapshot(), snap)["decode"]
    assert got.bandwidth_fraction == pytest.approx(1.0)
    assert got.advice == advice("decode", roofline(Cost(6e11, 3e11), 3.0, PEAKS))


PEAKS = Peaks(1e12, 100e9, "cpu", "float32", 2, 0.0)


def metrics(bottleneck: dict) -> BenchMetrics:
    d = Distribution(4, 1.0, 0.0, 1.0, {"p99": 1.0})
    return BenchMetrics(
        4, 4, 0, 2.0, 40, 400, 2.0, 200.0, 220.0, d, d, d, d, 250.0, 4, 0, bottleneck=bottleneck
    )


def test_summary_json_and_markdown(tmp_path, capsys) -> None:
    phases = bn.as_dicts(bn.bottleneck(bn.parse_roofline(BEFORE), bn.parse_roofline(AFTER)))
    run = RunResult("pdserve", 1.0, 1.0, None, metrics(phases), [])
    print_summary(run)
    out = capsys.readouterr().out
    assert "bottleneck (forward passes during the run" in out
    assert "  prefill: compute-bound: 40.0% of peak compute, 4.0% of peak bandwidth" in out
    assert "  decode: memory-bound: 16.0% of peak compute, 80.0% of peak bandwidth" in out
    assert "    decode at 80% of memory bandwidth (memory-bound)" in out
    print_summary(RunResult("vllm", 1.0, 1.0, None, metrics({}), []))
    assert "bottleneck" not in capsys.readouterr().out

    path = tmp_path / "r.json"
    write_json(path, result_document([run], {"dataset": "random"}))
    doc = json.loads(path.read_text())
    dec = doc["runs"][0]["metrics"]["bottleneck"]["decode"]
    assert dec["bound"] == "memory" and dec["bandwidth_fraction"] == pytest.approx(0.8)
    (restored,), _ = load_runs(path)
    assert restored.metrics.bottleneck == json.loads(json.dumps(phases))
    md = write_report([restored], tmp_path, "r", plots=False)["markdown"].read_text()
    assert "## Bottleneck" in md
    assert "| pdserve @ 1 req/s | decode | 4.00 | 2.0 | 10.0 |" in md
    assert "| 80.0% | memory |" in md
    assert "- pdserve @ 1 req/s, prefill: prefill at 40% of peak compute" in md
