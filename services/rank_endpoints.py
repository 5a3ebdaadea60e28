"""A TP worker's KV endpoints on its other ranks: starting them as rank 0's, and the table of
what each rank reports (pid, UCX transports) that the worker advertises."""

from __future__ import annotations

import asyncio
import os

from pdserve.services.engine.parallel.kv_link import RankLink
from pdserve.shared.config import WorkerConfig
from pdserve.shared.kv import ucx_check


async def start_other_ranks(
    link: RankLink, size: int, role: str, fingerprint: dict, config: WorkerConfig
) -> list[dict]:
    """Start the KV endpoint of ranks 1 .. ``size`` - 1 (rank r on ``--ucx-port`` + r); what
    each reported, by rank from 1."""
    port = config.ucx_port
    calls = (
        link.call(
            r,
            "start",
            role=role,
            fingerprint=fingerprint,
            host=config.ucx_host,
            port=port + r if port else 0,
            checksum=config.kv_checksum,
        )
        for r in range(1, size)
    )
    return list(await asyncio.gather(*calls))


def rank_table(others: list[dict]) -> list[dict]:
    """Each rank's pid and UCX transports, ours (rank 0, this process) first."""
    mine = {"pid": os.getpid(), "transports": ucx_check.process_transports()}
    return [
        {"rank": r, "pid": got["pid"], "transports": got["transports"]}
        for r, got in enumerate([mine, *others])
    ]
