"""How ``pdserve up`` splits a host's CPUs between its workers: one rule, read by the launcher
that places the workers and by ``pdserve doctor``, which measures the peaks at the thread
counts the workers will run with."""

from __future__ import annotations


def cpu_shares(cpus: list[int], ranks: list[int]) -> list[list[int]] | None:
    """Split ``cpus`` into one contiguous share per worker, ``ranks[i]`` being worker i's TP
    size. Every rank weighs the same (a TP-2 worker gets twice a TP-1 worker's share), and the
    first ranks take the remainder: prefill workers start first, and prefill is the compute-bound
    phase. None when there are fewer CPUs than ranks: the workers then share them all."""
    total = sum(ranks)
    if total < 1 or len(cpus) < total:
        return None
    size, extra = divmod(len(cpus), total)
    shares, start, rank = [], 0, 0
    for n in ranks:
        end = start + n * size + max(0, min(n, extra - rank))
        shares.append(cpus[start:end])
        start, rank = end, rank + n
    return shares
