"""A decode worker's pull of one prefilled request, over every rank of both workers.

Each decode rank pulls exactly its own KV heads (``shared/kv/tp_layout.pull_plan``), piece by
piece from the prefill ranks that hold them: rank 0 through its own ``KVClient``, the others
through their KV agents (``parallel/kv_agent.py``). All pieces run at once; the pull is done
when every piece is, and fails if any does. At TP 1 on both sides it is the one whole-block pull
it always was. With ``--kv-checksum`` each rank verifies the heads it pulled; a checksum failure
on any rank fails the pull as ``KVChecksumError`` (counted and marked by the decode worker).
``RankPuller`` is the decode side's ``KVPuller`` (``shared/kv/contract.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.services.engine.parallel.kv_link import RankCallFailed, RankLink
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.tp_layout import TP_KEY, PullPiece, pull_plan
from pdserve.shared.kv.transfer import KVChecksumError, KVClient, KVTransferError, TransferStats


@dataclass
class PiecePull:
    """One rank pair's part of a pull (a span of its own on the trace)."""

    decode_rank: int
    piece: PullPiece
    stats: TransferStats


class RankPuller:
    def __init__(self, client: KVClient, link: RankLink | None, num_kv_heads: int) -> None:
        self.client = client
        self.link = link
        self.num_kv_heads = num_kv_heads
        self.size = 1 if link is None else link.size

    def plan(self, handle: KVHandle) -> list[tuple[int, PullPiece]]:
        prefill_tp = int(handle.fingerprint.get(TP_KEY, 1))
        return [
            (rank, piece)
            for rank in range(self.size)
            for piece in pull_plan(self.num_kv_heads, prefill_tp, self.size, rank)
        ]

    async def pull(
        self, bus_id: str, handle: KVHandle, blocks: list[int], timeout: float
    ) -> tuple[TransferStats, list[PiecePull]]:
        """The whole pull: the summed stats (seconds: the longest piece) and each piece's."""
        self.client.check(handle)  # a layout that differs beyond TP: nothing moves
        addresses = handle.rank_addresses or [handle.ucx_address]
        plan = self.plan(handle)
        if any(p.prefill_rank >= len(addresses) for _, p in plan):
            raise KVTransferError(
                f"{handle.worker_id} names {len(addresses)} KV servers for TP "
                f"{handle.fingerprint.get(TP_KEY, 1)}"
            )
        jobs = [self._piece(bus_id, handle, blocks, timeout, r, p, addresses) for r, p in plan]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if any(isinstance(e, asyncio.CancelledError) for e in errors):
                raise asyncio.CancelledError
            errors.sort(key=lambda e: not isinstance(e, KVChecksumError))  # the one to report
            raise (
                errors[0]
                if isinstance(errors[0], KVTransferError)
                else KVTransferError(str(errors[0]))
            )
        pieces = [PiecePull(r, p, s) for (r, p), s in zip(plan, results, strict=True)]
        total = TransferStats(
            num_bytes=sum(s.num_bytes for s in results),
            num_blocks=max(s.num_blocks for s in results),
            num_messages=sum(s.num_messages for s in results),
            seconds=max(s.seconds for s in results),
            checksum_seconds=max(s.checksum_seconds for s in results),
        )
        return total, pieces

    async def _piece(
        self,
        bus_id: str,
        handle: KVHandle,
        blocks: list[int],
        timeout: float,
        rank: int,
        piece: PullPiece,
        addresses: list[str],
    ) -> TransferStats:
        address, heads = addresses[piece.prefill_rank], (piece.lo, piece.hi)
        if rank == 0:
            return await self.client.pull(
                bus_id, handle, blocks, timeout, address=address, heads=heads
            )
        try:
            got = await self.link.call(
                rank,
                "pull",
                bus_id=bus_id,
                handle=_wire(handle),
                dst_block_ids=list(blocks),
                timeout=timeout,
                address=address,
                heads=list(heads),
            )
        except RankCallFailed as exc:  # the agent's answer: "<exception class>: <message>"
            checksum = str(exc).startswith(KVChecksumError.__name__ + ":")
            error = KVChecksumError if checksum else KVTransferError
            raise error(f"decode rank {rank}: {exc}") from None
        return TransferStats(**got)


def _wire(handle: KVHandle) -> dict:
    return {
        "worker_id": handle.worker_id,
        "ucx_address": handle.ucx_address,
        "block_ids": list(handle.block_ids),
        "num_tokens": handle.num_tokens,
        "fingerprint": dict(handle.fingerprint),
        "lease_expires": handle.lease_expires,
        "token": handle.token,
        "rank_addresses": list(handle.rank_addresses),
        "epoch": handle.epoch,  # every rank's pull shows it: rank 0's server checks it
    }
