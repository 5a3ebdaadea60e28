"""The doctor's view of tensor-parallel workers: every rank of a worker of TP > 1 has its own
UCX KV endpoint in its own process, so each rank's transports are worth seeing - a rank whose
process lost the RDMA or CUDA transport the others have moves its heads at TCP speed.

Workers send them in their probe replies (``rank_pids``, ``rank_transports``: each rank's UCX
resources, ``ucx_check.process_transports``). One line per worker::

    prefill-0: TP 2 (rank 0 pid 123: tcp/lo; rank 1 pid 124: tcp/lo)

A rank's transports are grouped by device (``sysv+posix+cma/memory``) and ``self`` - a
process's endpoint to itself, which never carries KV - is left out; ``--json`` keeps each
rank's full list.
"""

from __future__ import annotations

from typing import Any

from pdserve.services.control.doctor.report import OK, WARN, Report

HIDDEN_TRANSPORTS = ("self",)
RankFacts = tuple[list[int], list[list[str]]]  # pids, transports: by rank


def compact_transports(resources: list[str]) -> str:
    """``["self/memory", "tcp/lo", "sysv/memory", "cma/memory"]`` -> ``tcp/lo, sysv+cma/memory``
    (devices in the order UCX lists them)."""
    by_device: dict[str, list[str]] = {}
    for resource in resources:
        transport, _, device = resource.partition("/")
        if transport in HIDDEN_TRANSPORTS:
            continue
        names = by_device.setdefault(device, [])
        if transport not in names:
            names.append(transport)
    return ", ".join(f"{'+'.join(names)}/{device}" for device, names in by_device.items())


def rank_line(worker_id: str, pids: list[int], transports: list[list[str]]) -> str:
    """``prefill-0: TP 2 (rank 0 pid 123: tcp/lo; rank 1 pid 124: tcp/lo)``."""
    ranks = [
        f"rank {rank} pid {pid}: {compact_transports(found) or 'transports unknown'}"
        for rank, (pid, found) in enumerate(zip(pids, transports, strict=True))
    ]
    return f"{worker_id}: TP {len(pids)} ({'; '.join(ranks)})"


def uneven_ranks(transports: list[list[str]]) -> list[str]:
    """Ranks lacking a transport another rank of the same worker has (devices aside: each
    rank may sit next to its own NIC). Ranks that reported nothing are not compared."""
    names = [{r.partition("/")[0] for r in found} - set(HIDDEN_TRANSPORTS) for found in transports]
    known = [n for n in names if n]
    every = set().union(*known) if known else set()
    return [
        f"rank {rank} has no {', '.join(sorted(every - found))}"
        for rank, found in enumerate(names)
        if found and every - found
    ]


def add_rank_check(report: Report, facts: dict[str, RankFacts]) -> None:
    """One check for every worker of TP > 1 (none when there is no such worker): a warning
    when the ranks of a worker do not have the same transports."""
    tp = {w: f for w, f in sorted(facts.items()) if len(f[0]) > 1}
    if not tp:
        return
    details = [rank_line(w, pids, found) for w, (pids, found) in tp.items()]
    uneven = {w: gaps for w, (_, found) in tp.items() if (gaps := uneven_ranks(found))}
    report.data["tp_ranks"] = {w: rank_records(*f) for w, f in tp.items()}
    if uneven:
        what = "; ".join(f"{w}: {', '.join(gaps)}" for w, gaps in uneven.items())
        report.add("TP ranks", WARN, f"!! ranks use different UCX transports ({what})", details)
    else:
        summary = f"{len(tp)} worker(s) of TP > 1, every rank with its own KV endpoint"
        report.add("TP ranks", OK, summary, details)


def rank_records(pids: list[int], transports: list[list[str]]) -> list[dict[str, Any]]:
    return [
        {"rank": rank, "pid": pid, "transports": found}
        for rank, (pid, found) in enumerate(zip(pids, transports, strict=True))
    ]
