"""Where a worker the autoscaler adds runs: the CPUs (sched affinity) and GPUs the fewest live
workers hold, so a new worker preempts the least."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    cpus: list[int] | None = None  # sched affinity; None = every CPU pdserve up may use
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES; None = left alone


def least_held(pool: Sequence[T], held: Sequence[Sequence[T]], n: int) -> list[T]:
    """The ``n`` items of ``pool`` that the fewest live workers hold (pool order on ties), in
    pool order: where a new worker preempts the least."""
    count = {x: 0 for x in pool}
    for items in held:
        for x in items:
            if x in count:
                count[x] += 1
    order = {x: i for i, x in enumerate(pool)}
    chosen = sorted(pool, key=lambda x: (count[x], order[x]))[: max(1, n)]
    return sorted(chosen, key=order.__getitem__)


def place(
    held: Sequence[Placement], cpus: list[int] | None, cpu_cost: int, gpus: list[str], tp: int
) -> Placement:
    """A new worker's place beside ``held``: ``cpu_cost`` of ``cpus`` (None: it floats) and,
    with two GPUs or more, ``tp`` of ``gpus`` (one GPU: everyone shares it, as pdserve up does)."""
    where = Placement()
    if cpus is not None:
        where = Placement(cpus=least_held(cpus, [p.cpus for p in held if p.cpus], cpu_cost))
    if len(gpus) >= 2:
        taken = [p.gpu.split(",") for p in held if p.gpu]
        where = Placement(where.cpus, ",".join(least_held(gpus, taken, tp)))
    return where
