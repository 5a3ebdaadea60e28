"""What loading a block from an offload tier costs, as a fraction of computing it (issue 33).

The router weighs a prefix hit in host memory or on disk by this fraction (``gateway/router.py``
``load_cost``; ``WorkerLoad.kv_host_load_cost`` / ``kv_disk_load_cost``). Both sides are
measured on what the worker actually did, as exponential moving averages: seconds per block
loaded from each tier (host memory: the copies into the pool, timed by CUDA events on a GPU so
nothing waits for them; disk: a read job from posting to done, queueing behind writes
included, as a sequence waits for it), and seconds per prompt token of forward passes that only
prefilled (a block then costs ``block_size`` of those). Until both sides of a tier have a
sample its cost is 0: "not measured", and the router's defaults apply.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

ALPHA = 0.2  # weight of the newest sample: about the last ten loads or passes count


def _ema(old: float, sample: float) -> float:
    return sample if old == 0.0 else old + ALPHA * (sample - old)


@dataclass
class LoadCosts:
    block_size: int
    token_seconds: float = 0.0  # per prompt token of a prefill-only forward pass
    # per block loaded, by tier ("host", "disk")
    block_seconds: dict[str, float] = field(default_factory=lambda: {"host": 0.0, "disk": 0.0})

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0.0:
            self.token_seconds = _ema(self.token_seconds, seconds / tokens)

    def observe_load(self, tier: str, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds > 0.0:
            self.block_seconds[tier] = _ema(self.block_seconds[tier], seconds / blocks)

    def cost(self, tier: str) -> float:
        """Loading one block from ``tier`` / computing one block; 0 until both are measured."""
        compute = self.token_seconds * self.block_size
        load = self.block_seconds.get(tier, 0.0)
        return load / compute if compute > 0.0 and load > 0.0 else 0.0

    def load_fields(self) -> dict[str, float]:
        """``WorkerLoad``'s fields."""
        return {"kv_host_load_cost": self.cost("host"), "kv_disk_load_cost": self.cost("disk")}


class CopyTimer:
    """Times the host-memory copies of a step. On CPU they are done when queued; on CUDA they
    are queued on the stream, so a pair of events brackets them and ``poll`` reads the ones
    that completed, never waiting."""

    def __init__(self, costs: LoadCosts, cuda: bool) -> None:
        self.costs = costs
        self.cuda = cuda
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()

    def start(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin

    def stop(self, started: object, blocks: int) -> None:
        if not self.cuda:
            self.costs.observe_load("host", blocks, time.perf_counter() - started)  # type: ignore[operator]
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((started, end, blocks))  # type: ignore[arg-type]

    def poll(self) -> None:
        while self._pending and self._pending[0][1].query():
            begin, end, blocks = self._pending.popleft()
            self.costs.observe_load("host", blocks, begin.elapsed_time(end) / 1000.0)
