"""The peaks cache without measuring (shared/telemetry/peaks.py): one JSON per device key, written
atomically, a full measurement never replaced by a quick one, a damaged file read as absent; the
last-level cache size that sizes the read buffer; and the doctor's peaks lines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.services.control.doctor import peaks as doctor_peaks
from pdserve.services.control.doctor.report import FAIL, OK, Report
from pdserve.shared.telemetry import peaks, read_buffer
from pdserve.shared.telemetry.roofline import Peaks

KEY = "cpu: Test CPU, 2 threads | float32"
PEAKS = Peaks(1.5e11, 3.0e10, "cpu: Test CPU, 2 threads", "float32", 2, 1_700_000_000.0)


def files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_round_trip(tmp_path: Path) -> None:
    assert peaks.read_cached(KEY, tmp_path) is None  # nothing cached yet
    assert peaks.store(PEAKS, KEY, False, tmp_path, gemm_n=4096)
    assert peaks.read_cached(KEY, tmp_path) == (PEAKS, False)
    body = json.loads(peaks.cache_path(KEY, tmp_path).read_text())
    assert body["key"] == KEY and body["gemm_n"] == 4096 and body["quick"] is False


def test_one_entry_per_cpu_model_threads_and_dtype(tmp_path: Path, monkeypatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: avx2\n")
    monkeypatch.setattr(peaks, "CPU_INFO", cpuinfo)
    keys = {
        peaks.cache_key("cpu", dtype, threads)
        for dtype in ("float32", "bfloat16")
        for threads in (1, 2)
    }
    assert len(keys) == 4 and all("Test CPU 9000" in k for k in keys)
    assert peaks.cache_key("cpu", "float32", 1) == "cpu: Test CPU 9000, 1 thread | float32"
    cache = tmp_path / "cache"
    for key in keys:
        assert peaks.store(replace(PEAKS, device=key), key, True, cache)
    assert len(files(cache)) == 4  # one file each, none overwritten by another key
    for key in keys:
        held = peaks.read_cached(key, cache)
        assert held is not None and held[0].device == key


def test_keys_that_slug_alike_keep_their_own_files(tmp_path: Path) -> None:
    a, b = "cpu: X/Y, 1 thread | float32", "cpu: X Y, 1 thread | float32"
    assert peaks.cache_path(a, tmp_path) != peaks.cache_path(b, tmp_path)


def test_a_full_measurement_beats_a_quick_one(tmp_path: Path) -> None:
    quick, full = replace(PEAKS, flops_per_s=1e11), replace(PEAKS, flops_per_s=2e11)
    assert peaks.store(quick, KEY, True, tmp_path)
    # quick over quick: the highest of each roof (one under contention reads low, never high)
    assert peaks.store(replace(quick, bytes_per_s=1e10, flops_per_s=3e11), KEY, True, tmp_path)
    assert peaks.read_cached(KEY, tmp_path) == (replace(quick, flops_per_s=3e11), True)
    assert peaks.quick_runs(KEY, tmp_path) == 2
    assert peaks.store(quick, KEY, True, tmp_path)
    assert peaks.store(full, KEY, False, tmp_path)  # full over quick
    assert peaks.read_cached(KEY, tmp_path) == (full, False)
    assert not peaks.store(quick, KEY, True, tmp_path)  # quick never over full
    assert peaks.read_cached(KEY, tmp_path) == (full, False)
    newer = replace(full, flops_per_s=3e11)
    assert peaks.store(newer, KEY, False, tmp_path)  # a new full one replaces the old
    assert peaks.read_cached(KEY, tmp_path) == (newer, False)


def test_the_write_is_atomic(tmp_path: Path) -> None:
    """Written beside and renamed: a write that breaks half way leaves the old file whole and no
    temporary behind (here the body cannot be serialised, after the temporary was opened)."""
    peaks.store(PEAKS, KEY, False, tmp_path)
    before = peaks.cache_path(KEY, tmp_path).read_text()
    with pytest.raises(TypeError):
        peaks.store(replace(PEAKS, flops_per_s=9e11), KEY, False, tmp_path, bad=object())
    assert peaks.cache_path(KEY, tmp_path).read_text() == before
    assert files(tmp_path) == [peaks.cache_path(KEY, tmp_path).name]


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: "\x00\x01garbage",
        lambda text: "[]",
        lambda text: text.replace('"version": 1', '"version": 999'),
        lambda text: text.replace(KEY, "cpu: another, 2 threads | float32"),
        lambda text: text.replace('"flops_per_s": 150000000000.0', '"flops_per_s": -1.0'),
        lambda text: text.replace('"quick": false', '"quick": "no"'),
        lambda text: text.replace('"threads": 2,', ""),
    ],
)
def test_a_damaged_file_reads_as_absent(tmp_path: Path, damage, caplog) -> None:
    peaks.store(PEAKS, KEY, False, tmp_path)
    path = peaks.cache_path(KEY, tmp_path)
    damaged = damage(path.read_text())
    assert damaged != path.read_text()
    path.write_text(damaged)
    assert peaks.read_cached(KEY, tmp_path) is None
    assert peaks.store(PEAKS, KEY, True, tmp_path)  # so a quick one may replace it
    assert peaks.read_cached(KEY, tmp_path) == (PEAKS, True)


def cache_dir(root: Path, cpu: int, index: int, level: int, kind: str, size: str, shared: str):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size)):
        (d / name).write_text(f"{value}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_last_level_cache_counts_each_instance_once(tmp_path: Path) -> None:
    # two core complexes of two CPUs, an L3 each; L1i/L1d/L2 per CPU
    for cpu in range(4):
        cache_dir(tmp_path, cpu, 0, 1, "Data", "32K", str(cpu))
        cache_dir(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        cache_dir(tmp_path, cpu, 2, 2, "Unified", "1024K", str(cpu))
        cache_dir(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    assert read_buffer.llc_bytes(tmp_path) == 64 << 20
    assert read_buffer.llc_bytes(tmp_path / "missing") == 0


def test_the_read_buffer_outgrows_the_caches() -> None:
    nbytes = read_buffer.cpu_read_bytes()
    assert nbytes >= min(read_buffer.MIN_READ_BYTES, read_buffer._mem_available() // 4)
    assert nbytes <= read_buffer.MAX_CPU_READ_BYTES


@pytest.mark.parametrize(("cpus", "threads"), [(1, [1]), (2, [1]), (3, [2, 1]), (16, [8])])
def test_the_doctor_measures_at_the_threads_pdserve_up_gives_workers(cpus, threads) -> None:
    assert doctor_peaks.up_worker_threads(cpus) == threads


def test_the_doctor_reports_peaks_beside_the_ucx_figures() -> None:
    report = Report()
    target = doctor_peaks.Target("cpu", "float32", 2)
    found = {
        "flops_per_s": 1.5e11,
        "bytes_per_s": 3.0e10,
        "device": "cpu: Test CPU, 2 threads",
        "dtype": "float32",
        "ridge": 5.0,
        "gemm_n": 4096,
        "read_bytes": 256 << 20,
        "seconds": 8.2,
        "quick": False,
        "cache": "/c/peaks/x.json",
        "kept": None,
    }
    doctor_peaks.add_peaks_check(report, target, found)
    doctor_peaks.add_peaks_check(report, target, RuntimeError("CUDA out of memory"))
    text = report.render()
    assert (
        "[ OK ] peaks  cpu: Test CPU, 2 threads, float32: 150.0 GFLOP/s, 30.0 GB/s read, " in text
    )
    assert "ridge 5.0 FLOP/byte" in text and "cached for the workers: /c/peaks/x.json" in text
    assert [c.status for c in report.checks] == [OK, FAIL] and report.exit_code == 1
    assert "cpu float32, 2 thread(s): measuring failed: CUDA out of memory" in text
    assert report.data["peaks"] == [found]


def test_starts_measure_again_until_enough_quick_runs_merged(tmp_path: Path, monkeypatch) -> None:
    """A start beside other loading workers reads low: the next starts measure again and the
    cache keeps the highest, until QUICK_RUNS readings are in; then starts only read it."""
    readings = iter([2e10, 5e10, 4e10])
    calls = []

    def fake(device, dtype, threads, plan):
        calls.append(plan)
        return replace(PEAKS, bytes_per_s=next(readings)), {}

    monkeypatch.setattr(peaks, "measure_with", fake)
    monkeypatch.setattr(peaks, "cache_key", lambda device, dtype, threads: KEY)
    got = [peaks.load_or_measure("cpu", "float32", 2, tmp_path).bytes_per_s for _ in range(5)]
    assert got == [2e10, 5e10, 5e10, 5e10, 5e10]
    assert len(calls) == peaks.QUICK_RUNS == 3
    assert peaks.quick_runs(KEY, tmp_path) == 3
