"""This machine's two roofs, measured where pdserve runs, and cached per device.

A roofline needs the peaks of the hardware the steps ran on, not a spec sheet: a VM's vCPUs, a
worker's share of the cores, a bf16 GEMM on a CPU without bf16 instructions, or a power-capped GPU
all sit well below the datasheet. So both roofs are measured with torch itself:

- **compute**: dense square GEMMs at the model's dtype, grown until one takes long enough to be
  compute-bound and timed well above the clock's resolution, best of a few; 2 n^3 FLOPs each. On a
  CPU at the worker's torch thread count, on a GPU timed with CUDA events after a warm-up. The dtype
  runs as it really does: a slow bf16 CPU GEMM is measured slow, never replaced by fp32.
- **memory**: a sum over a buffer several times larger than the last-level cache, best of a few,
  counting the bytes *read* (the buffer's size once per pass). A read, not a copy: a decode step's
  traffic is reads (weights, KV), and a copy's bytes depend on how one counts its writes (a CPU
  also reads each destination line before writing it, unless it uses streaming stores), which
  would blur the roof a decode step is held to.

``measure`` runs them (quick: ~1-3 s for a worker's start; full: ~10-20 s for ``pdserve doctor``);
``load_or_measure`` returns the cached peaks of a device key (CPU model + threads + dtype, or GPU
name + dtype) or measures quickly and caches. The cache is one JSON per key under
``$PDSERVE_CACHE_DIR/peaks/``; a full measurement replaces a quick one, never the reverse.

A quick measurement at a worker's start often runs beside other workers loading their models,
and a roof measured under contention can only come out low. So quick results merge by maximum,
and the first ``QUICK_RUNS`` starts each measure again: one low reading does not stay the roof
until ``pdserve doctor`` measures in full.

torch is imported inside the functions: reading the cache stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.shared.telemetry.read_buffer import cpu_read_bytes
from pdserve.shared.telemetry.roofline import Peaks

log = logging.getLogger(__name__)

CACHE_VERSION = 1
QUICK_RUNS = 3  # quick measurements merged into a key's cache before starts stop measuring
CPU_INFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Plan:
    """How hard to look: sizes and time budgets of one measurement."""

    max_n: int  # largest GEMM side tried
    min_sample_s: float  # a timed GEMM sample lasts at least this long (matmuls repeat to fill it)
    gemm_s: float  # the GEMM's timed samples stop once they have taken this long ...
    min_samples: int  # ... but never before this many,
    max_samples: int  # ... and never after this many
    reads: int  # timed passes over the read buffer
    read_bytes: int  # size of the read buffer; 0: sized from the caches (CPU)
    start_n: int = 256  # first GEMM side of the growth


CPU_QUICK = Plan(
    max_n=2048, min_sample_s=0.05, gemm_s=0.5, min_samples=2, max_samples=5, reads=3, read_bytes=0
)
CPU_FULL = Plan(
    max_n=4096, min_sample_s=0.25, gemm_s=6.0, min_samples=3, max_samples=20, reads=12, read_bytes=0
)
# A GPU's samples stay short in full mode too: under a sustained GEMM the clocks fall to the power
# limit (an H200: ~790 TFLOP/s in 20 ms samples, ~690 in 0.1 s ones), and a prefill step, a burst,
# can reach the higher rate; a roof must sit above what a step reaches.
GPU_QUICK = Plan(
    max_n=8192,
    min_sample_s=0.02,
    gemm_s=0.3,
    min_samples=3,
    max_samples=10,
    reads=10,
    read_bytes=2 << 30,
    start_n=1024,
)
GPU_FULL = Plan(
    max_n=8192,
    min_sample_s=0.02,
    gemm_s=1.5,
    min_samples=10,
    max_samples=60,
    reads=30,
    read_bytes=4 << 30,
    start_n=1024,
)


# -- device keys -------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``AMD EPYC 7B13``), else the platform's."""
    try:
        for line in CPU_INFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown cpu"


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def device_name(device: str, threads: int) -> str:
    """What is measured, in words: ``cpu: AMD EPYC, 2 threads`` or ``cuda: NVIDIA H200``."""
    if is_cuda(device):
        import torch

        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu: {cpu_model()}, {threads} thread{'s' if threads != 1 else ''}"


def cache_key(device: str, dtype: str, threads: int) -> str:
    """One cache entry per device key: CPU model + threads + dtype, or GPU name + dtype (two GPUs
    of one model share their peaks; the index is not part of it)."""
    return f"{device_name(device, threads)} | {dtype}"


def cache_path(key: str, cache_dir: Path) -> Path:
    # Readable, and unique: the slug may fold two keys together, the hash never does.
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key).strip("-").lower()[:80]
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return cache_dir / f"{slug}-{digest}.json"


def default_cache_dir() -> Path:
    from pdserve.shared.models.demo import cache_dir

    return cache_dir() / "peaks"


# -- the cache ---------------------------------------------------------------------------------


def read_cached(key: str, cache_dir: Path) -> tuple[Peaks, bool] | None:
    """The cached peaks of ``key`` and whether they came from a quick measurement; None when
    there are none, or the file is unreadable, of another version or another key (re-measure)."""
    path = cache_path(key, cache_dir)
    try:
        body = json.loads(path.read_text())
        if body.get("version") != CACHE_VERSION or body.get("key") != key:
            return None
        peaks = Peaks(**body["peaks"])
        quick = body["quick"]
        if not isinstance(quick, bool) or not (peaks.flops_per_s > 0 and peaks.bytes_per_s > 0):
            return None
        return peaks, quick
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("peaks cache %s unreadable (%s): measuring again", path, exc)
        return None


def store(peaks: Peaks, key: str, quick: bool, cache_dir: Path, **extra: Any) -> bool:
    """Cache ``peaks`` under ``key``, atomically (a reader sees the old file or the new one,
    never half of one). A quick measurement never replaces a full one: returns False then. (The
    check and the rename are not one step: a doctor finishing between a worker's check and its
    rename loses to the quick result, and its next run puts a full one back.)"""
    runs = 1
    if quick:
        held = read_cached(key, cache_dir)
        if held is not None and not held[1]:
            return False
        if held is not None:  # quick over quick: a roof is the highest reading seen
            peaks = replace(
                peaks,
                flops_per_s=max(peaks.flops_per_s, held[0].flops_per_s),
                bytes_per_s=max(peaks.bytes_per_s, held[0].bytes_per_s),
            )
            runs += quick_runs(key, cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    body = {
        "version": CACHE_VERSION,
        "key": key,
        "quick": quick,
        "peaks": asdict(peaks),
        "quick_runs": runs if quick else 0,
        **extra,
    }
    fd, tmp = tempfile.mkstemp(prefix=".peaks-", suffix=".tmp", dir=cache_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, cache_path(key, cache_dir))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def load_or_measure(device: str, dtype: str, threads: int, cache_dir: Path | None = None) -> Peaks:
    """This device key's cached peaks, else a quick measurement, cached for the next start."""
    device, threads = resolve(device, threads)
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    key = cache_key(device, dtype, threads)
    held = read_cached(key, cache_dir)
    if held is not None and (not held[1] or quick_runs(key, cache_dir) >= QUICK_RUNS):
        return held[0]
    peaks, detail = measure_with(device, dtype, threads, plan_for(device, quick=True))
    try:
        store(peaks, key, True, cache_dir, **detail)
    except OSError as exc:  # a read-only cache costs a measurement per start, nothing else
        log.warning("cannot cache peaks in %s: %s", cache_dir, exc)
    merged = read_cached(key, cache_dir)
    return merged[0] if merged is not None else peaks


def quick_runs(key: str, cache_dir: Path) -> int:
    """How many quick measurements the cached entry of ``key`` merges (0: none, or full)."""
    try:
        runs = json.loads(cache_path(key, cache_dir).read_text()).get("quick_runs", 1)
    except (OSError, ValueError, AttributeError):
        return 0
    return runs if isinstance(runs, int) else 0


# -- measuring ---------------------------------------------------------------------------------


def resolve(device: str, threads: int) -> tuple[str, int]:
    """``cuda`` -> ``cuda:<current>`` with threads 0; a CPU with threads <= 0 -> torch's own."""
    import torch

    if is_cuda(device):
        index = torch.device(device).index
        return f"cuda:{torch.cuda.current_device() if index is None else index}", 0
    return "cpu", threads if threads > 0 else torch.get_num_threads()


def plan_for(device: str, quick: bool) -> Plan:
    if is_cuda(device):
        return GPU_QUICK if quick else GPU_FULL
    return CPU_QUICK if quick else CPU_FULL


def measure(device: str, dtype: str, threads: int, quick: bool) -> Peaks:
    """Measure both roofs of ``device`` at ``dtype`` (and ``threads`` torch threads on a CPU)."""
    device, threads = resolve(device, threads)
    return measure_with(device, dtype, threads, plan_for(device, quick))[0]


def measure_with(device: str, dtype: str, threads: int, plan: Plan) -> tuple[Peaks, dict[str, Any]]:
    """The peaks, and how they were taken (GEMM side, read buffer bytes, seconds, torch)."""
    import contextlib

    import torch

    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"not a floating-point torch dtype: {dtype!r}")
    started = time.perf_counter()
    previous = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(threads)  # the worker's pool size, restored below
    # events and kernels on the measured GPU, whichever is current
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    try:
        with on_device:
            flops, n = gemm_flops(dev, torch_dtype, plan)
            read_bytes = plan.read_bytes or cpu_read_bytes()
            bandwidth = read_bandwidth(dev, read_bytes, plan.reads)
    finally:
        if dev.type == "cpu":
            torch.set_num_threads(previous)
        else:  # hand the buffers back to CUDA: a worker sizes its KV cache from what is free
            torch.cuda.empty_cache()
    peaks = Peaks(
        flops_per_s=flops,
        bytes_per_s=bandwidth,
        device=device_name(device, threads),
        dtype=dtype,
        threads=threads if dev.type == "cpu" else 0,
        measured_at=time.time(),
    )
    detail = {
        "gemm_n": n,
        "read_bytes": read_bytes,
        "seconds": round(time.perf_counter() - started, 3),
        "torch": torch.__version__,
    }
    return peaks, detail


def _timer(dev) -> Callable[[Callable[[], object], int], float]:
    """Seconds ``k`` calls of ``fn`` take: CUDA events on a GPU (the host only queues work),
    the wall clock on a CPU."""
    import torch

    if dev.type != "cuda":

        def wall(fn: Callable[[], object], k: int) -> float:
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            return time.perf_counter() - t0

        return wall

    def events(fn: Callable[[], object], k: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return events


def gemm_flops(dev, dtype, plan: Plan) -> tuple[float, int]:
    """Best FLOP/s of ``n x n @ n x n`` at ``dtype``, and the n: n doubles from ``start_n`` until
    one product takes ``min_sample_s`` (compute-bound, well above timer noise) or reaches
    ``max_n``; the growth's last product is the warm-up of the timed samples."""
    import torch

    timed = _timer(dev)
    n = plan.start_n
    while True:
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        c = torch.empty(n, n, device=dev, dtype=dtype)

        def product(a=a, b=b, c=c) -> object:
            return torch.mm(a, b, out=c)

        if n == plan.start_n:
            timed(product, 1)  # warm-up: the BLAS library's set-up, the thread pool's start
        one = timed(product, 1)
        if one >= plan.min_sample_s or n >= plan.max_n:
            break
        n *= 2
    k = max(1, math.ceil(plan.min_sample_s / max(one, 1e-9)))  # products per timed sample
    best, spent, samples = 0.0, 0.0, 0
    while samples < plan.min_samples or (spent < plan.gemm_s and samples < plan.max_samples):
        seconds = timed(product, k)
        best = max(best, 2.0 * n**3 * k / seconds)
        spent, samples = spent + seconds, samples + 1
    return best, n


def read_bandwidth(dev, nbytes: int, reads: int) -> float:
    """Best bytes/s of a sum over an ``nbytes`` float32 buffer: bytes read, one pass each. The
    sum's arithmetic (one add per 4 bytes, vectorised and spread over the torch threads) stays
    far below any roof's compute, so the memory system sets its pace."""
    import torch

    timed = _timer(dev)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)  # pages touched here
    try:
        timed(buf.sum, 1)  # warm-up: the reduction's threads and scratch
        return max(buf.numel() * 4 / timed(buf.sum, 1) for _ in range(reads))
    finally:
        del buf
