"""When each request is sent: Poisson or gamma inter-arrival times.

Same model as `vllm bench serve`: gaps are gamma distributed with shape = burstiness and mean
1 / request_rate. Burstiness 1 is a Poisson process; below 1 traffic comes in bursts, above 1
it is more evenly spaced. An infinite rate sends everything at once (then only
--max-concurrency limits the load).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def arrival_offsets(
    n: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """Send times in seconds from the start of the run; the first request goes at 0."""
    if n <= 0:
        return np.zeros(0)
    if request_rate <= 0:
        raise ValueError("request rate must be positive (use inf for all at once)")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(request_rate):
        return np.zeros(n)
    scale = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    gaps = rng.gamma(shape=burstiness, scale=scale, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def paced(
    items: Sequence[T], offsets: np.ndarray, start: float | None = None
) -> AsyncIterator[tuple[int, T]]:
    """Yield (index, item) at `start` (perf_counter seconds; default: now) plus its offset.

    Sleeping until an absolute deadline (not for each gap) keeps timer and event-loop delays
    from accumulating over a long run.
    """
    if start is None:
        start = time.perf_counter()
    for i, item in enumerate(items):
        delay = start + float(offsets[i]) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield i, item
