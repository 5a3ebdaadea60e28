"""Hand-made inputs for the planner's tests: a profile whose numbers are easy to work by hand, and
metrics windows built from a few numbers."""

from __future__ import annotations

from pdserve.services.control.planner.inputs import MetricsWindow, WorkerSample
from pdserve.services.control.planner.profile import Profile

# With hand_profile() and ITL <= 30 ms, one decode worker runs batch 41 at 30 ms: 1366.67 tok/s.
DECODE_TOKENS_PER_S = 41 / 0.030


def hand_profile(kv_capacity: int = 1_000_000) -> Profile:
    """Prefill 10,000 tok/s at any length; decode ITL = 10 + 0.5 (batch - 1) ms at any context."""
    return Profile.from_points(
        [(100, 10_000.0), (10_000, 10_000.0)],
        [(b, c, 10.0 + 0.5 * (b - 1)) for b in (1, 65) for c in (100, 10_000)],
        kv_capacity_tokens=kv_capacity,
    )


def osl_for(decode_need: float, rate: float) -> float:
    """The output length that makes the decode arithmetic need ``decode_need`` workers."""
    return decode_need * DECODE_TOKENS_PER_S / rate


def window(
    *,
    rate: float = 10.0,
    isl: float = 100.0,
    osl: float = 100.0,
    prefill: int = 1,
    decode: int = 1,
    kv: float | list[float] = 0.1,
    decode_queue: int = 0,
    prefill_queue: int = 0,
    running: int = 10,
    age: float | list[float] = 600.0,
    ttft_ms: float | None = None,
    itl_ms: float | None = None,
    duration: float = 30.0,
) -> MetricsWindow:
    """A window of ``rate`` req/s; per-worker lists (kv, age) apply to the decode workers."""
    kvs = kv if isinstance(kv, list) else [kv] * decode
    ages = age if isinstance(age, list) else [age] * decode
    workers = [WorkerSample(f"p{i}", "prefill", 600.0, 0.0, prefill_queue) for i in range(prefill)]
    workers += [
        WorkerSample(f"d{i}", "decode", ages[i], kvs[i], decode_queue, running)
        for i in range(decode)
    ]
    return MetricsWindow(
        duration_s=duration,
        requests=round(rate * duration),
        mean_isl=isl if rate else 0.0,
        mean_osl=osl if rate else 0.0,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        workers=tuple(workers),
    )
