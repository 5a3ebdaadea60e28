"""Measuring the peaks for real with torch (shared/telemetry/peaks.py), at small sizes: plausible
numbers, the caller's thread pool left as it was, and load_or_measure's cache in a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.shared.telemetry import peaks

# Small enough for a test (~0.2 s), large enough to leave the caches for the read.
TINY = peaks.Plan(256, 0.005, 0.05, 2, 3, reads=2, read_bytes=32 << 20, start_n=64)


@pytest.mark.parametrize(("dtype", "threads"), [("float32", 1), ("float32", 2), ("bfloat16", 1)])
def test_measured_peaks_are_positive_and_plausible(dtype: str, threads: int) -> None:
    before = torch.get_num_threads()
    found, detail = peaks.measure_with("cpu", dtype, threads, TINY)
    assert torch.get_num_threads() == before  # the worker's own pool is left as it was
    assert 1e6 < found.flops_per_s < 1e16 and 1e6 < found.bytes_per_s < 1e13
    assert found.dtype == dtype and found.threads == threads
    assert found.device.startswith("cpu: ") and found.device.endswith(
        f"{threads} thread" + "s" * (threads > 1)
    )
    assert 64 <= detail["gemm_n"] <= 256 and detail["read_bytes"] == 32 << 20
    assert 0 < found.ridge < 1e6


def test_not_a_float_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="int8"):
        peaks.measure_with("cpu", "int8", 1, TINY)


def test_load_or_measure_measures_once_then_reads_the_cache(tmp_path: Path) -> None:
    """The quick measurement a worker makes at start (sizes as a worker's), cached: the first
    QUICK_RUNS starts measure and merge by maximum, later starts read it; a damaged file is
    measured again and rewritten whole."""
    first = peaks.load_or_measure("cpu", "float32", 1, tmp_path)
    assert first.threads == 1 and first.flops_per_s > 1e6 and first.bytes_per_s > 1e6
    (path,) = tmp_path.iterdir()
    body = json.loads(path.read_text())
    assert body["quick"] is True and body["read_bytes"] >= 64 << 20 and body["quick_runs"] == 1
    for _ in range(peaks.QUICK_RUNS - 1):
        merged = peaks.load_or_measure("cpu", "float32", 1, tmp_path)
    assert merged.bytes_per_s >= first.bytes_per_s and merged.flops_per_s >= first.flops_per_s
    assert json.loads(path.read_text())["quick_runs"] == peaks.QUICK_RUNS
    assert peaks.load_or_measure("cpu", "float32", 1, tmp_path) == merged  # not re-measured
    path.write_text(path.read_text()[:40])
    again = peaks.load_or_measure("cpu", "float32", 1, tmp_path)
    assert again.measured_at > merged.measured_at
    assert peaks.read_cached(peaks.cache_key("cpu", "float32", 1), tmp_path) == (again, True)


def test_threads_zero_on_a_cpu_means_the_callers_pool() -> None:
    assert peaks.resolve("cpu", 0) == ("cpu", torch.get_num_threads())
    assert peaks.resolve("cpu", 3) == ("cpu", 3)
