"""The doctor's roofline check: this host's peak GEMM FLOP/s and memory-read bandwidth, measured
in full (``shared/telemetry/peaks.py``) where the workers will run, and cached for them.

Which device and dtype: the engine's own ``--device`` / ``--dtype`` (and their PDSERVE_ variables),
``auto`` resolving as the engine does: every distinct GPU model in bf16 on a GPU host, else the CPU
in fp32. Which thread count on a CPU: ``--torch-threads`` when set, else each share of the CPUs
that ``pdserve up`` gives its default workers (one prefill, one decode: each its own CPUs), since
that pool size is what their steps run at.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from pdserve.services.control.doctor.report import FAIL, OK, Report
from pdserve.shared.cpus import cpu_shares
from pdserve.shared.telemetry import peaks as peaks_mod


@dataclass(frozen=True)
class Target:
    device: str  # "cpu" or "cuda:<index>"
    dtype: str  # torch dtype name
    threads: int  # torch threads on a CPU, 0 on a GPU


def up_worker_threads(cpus: int) -> list[int]:
    """The torch threads of ``pdserve up``'s default 1 prefill + 1 decode worker on ``cpus``
    CPUs (``shared/cpus.cpu_shares``, the launcher's rule); with fewer CPUs than workers, both
    share them all at one thread each. Distinct sizes, largest first."""
    shares = cpu_shares(list(range(cpus)), [1, 1])
    return sorted({len(s) for s in shares}, reverse=True) if shares else [1]


def targets(device: str, dtype: str, torch_threads: int) -> list[Target]:
    """What to measure for ``--device`` / ``--dtype`` / ``--torch-threads`` (see the module)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        gpu_dtype = "bfloat16" if dtype == "auto" else dtype
        if device != "cuda":  # one GPU asked for by index
            return [Target(device, gpu_dtype, 0)]
        first_of_model: dict[str, int] = {}  # GPUs of one model share a cache entry
        for i in range(torch.cuda.device_count()):
            first_of_model.setdefault(torch.cuda.get_device_name(i), i)
        return [Target(f"cuda:{i}", gpu_dtype, 0) for i in first_of_model.values()]
    cpu_dtype = "float32" if dtype == "auto" else dtype
    if torch_threads > 0:
        threads = [torch_threads]
    else:
        threads = up_worker_threads(len(os.sched_getaffinity(0)))
    return [Target("cpu", cpu_dtype, n) for n in threads]


def measure_and_cache(target: Target, quick: bool) -> dict:
    """Measure ``target``'s peaks and cache them (a full result replaces a quick one); what was
    found, as the report's JSON holds it."""
    plan = peaks_mod.plan_for(target.device, quick)
    peaks, detail = peaks_mod.measure_with(target.device, target.dtype, target.threads, plan)
    cache_dir = peaks_mod.default_cache_dir()
    key = peaks_mod.cache_key(target.device, target.dtype, target.threads)
    cached = peaks_mod.store(peaks, key, quick, cache_dir, **detail)
    path = peaks_mod.cache_path(key, cache_dir)
    return {
        **asdict(peaks),
        **detail,
        "ridge": peaks.ridge,
        "quick": quick,
        "cache": str(path) if cached else None,
        "kept": None if cached else str(path),
    }


def add_peaks_check(report: Report, target: Target, found: dict | Exception) -> None:
    what = f"{target.device} {target.dtype}" + (
        f", {target.threads} thread(s)" if target.device == "cpu" else ""
    )
    if isinstance(found, Exception):
        report.add("peaks", FAIL, f"{what}: measuring failed: {found}")
        return
    report.data.setdefault("peaks", []).append(found)
    summary = (
        f"{found['device']}, {found['dtype']}: {found['flops_per_s'] / 1e9:,.1f} GFLOP/s, "
        f"{found['bytes_per_s'] / 1e9:,.1f} GB/s read, ridge {found['ridge']:.1f} FLOP/byte"
    )
    n, mib = found["gemm_n"], found["read_bytes"] / (1 << 20)
    details = [
        f"GEMM {n}x{n}x{n}, read {mib:,.0f} MiB, "
        f"{'quick' if found['quick'] else 'full'} measurement in {found['seconds']:.1f} s",
        f"cached for the workers: {found['cache']}"
        if found["cache"]
        else f"not cached: {found['kept']} holds a full measurement",
    ]
    report.add("peaks", OK, summary, details)
