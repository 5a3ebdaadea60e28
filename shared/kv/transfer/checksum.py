"""Integrity of pulled KV (``--kv-checksum``): an xxh3-64 hash per (block, KV head), taken by the
prefill side when it leases the blocks and checked by the puller on what landed in its cache.

**The unit: one KV head of one block.** A head's bytes in a block are, for each part of the
storage in order (values, then scales for a quantized cache), ``part[block, :, :, :, head]`` in
C order: the same bytes whatever a cache's TP layout, since a rank's cache only drops the other
heads (``heads.py``). So the hashes a prefill rank takes of its own shard answer any pull: whole
blocks between equal layouts, or any head slice a ``tp_layout.pull_plan`` asks for (the server
sends the columns of the heads pulled), and each decode rank checks exactly the heads it pulled.
A hash per block of the raw block bytes would be cheaper to take (no gather, below) but would
mean something only between equal layouts; a hash per (block, head range as pulled) cannot be
taken at lease time, when the puller's layout is not known yet. An opaque cache (no ``split``,
whole-block pulls only) has one unit per block: its raw bytes.

**When and where.** Each prefill rank's ``KVServer`` hashes a lease's blocks when the lease is
added (``LeaseTable.on_add``; rank 0's KV agents add their mirror of it, so each rank hashes its
own shard), in a thread, without holding up the ``PrefillResult``. Hashing at lease time rather
than when sending also catches the cache changing under a lease (a block reused too early), not
only bytes damaged on the wire or on landing. A puller that asks (``checksum`` in its request)
gets, after the reply, one more message on tag ``T+3``: the ``uint64`` hashes of the pulled
blocks (in the order of the request's runs) by pulled head; the reply says how many per block.
A lease taken while the server was not hashing is hashed when sent (so a decode worker with
``--kv-checksum`` still checks the transport against a prefill worker without it).

**The check.** Once every byte has landed (and been unpacked), the puller hashes its destination
blocks' heads - the KV as it will be served - off the event loop, and raises ``KVChecksumError``
on any difference: the decode worker hands that to ``--kv-failure-policy`` like any failed pull,
so the blocks are never committed and a recompute overwrites them.

**Cost.** A head's bytes are strided in the cache (``head_dim`` elements per row), so each block
is gathered head-major into a small reused buffer before hashing (CPU: cache-resident; a CUDA
cache is copied to the host block by block). ``perf/kv_checksum_bench.py`` measures the pull
with and without the check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.shared.kv.transfer.heads import Heads, HeadSlicer
from pdserve.shared.kv.transfer.wire import KVTransferError, retrieve


class KVChecksumError(KVTransferError):
    """The KV that landed is not the KV that was leased: it must never be served."""


def digest(data: Any) -> int:
    """The KV path's one hash, xxh3-64, of a buffer's bytes: a (block, head) unit here, a whole
    block in a disk tier file (``services/engine/kv_tiers``)."""
    return xxhash.xxh3_64_intdigest(data)


def run_blocks(runs: Sequence[Sequence[int]]) -> list[int]:
    """The block ids of ``(start, count)`` runs, in order."""
    return [b for start, count in runs for b in range(start, start + count)]


class KVHasher:
    """xxh3-64 hashes of (block, KV head) units of one rank's cache (see the module docstring)."""

    def __init__(self, kv_cache: torch.Tensor, slicer: HeadSlicer) -> None:
        self.kv_cache = kv_cache
        self.slicer = slicer

    @property
    def held(self) -> Heads:
        return self.slicer.heads

    def units(self, heads: Heads) -> int:
        """Hashes per block for a pull of global ``heads``."""
        return heads[1] - heads[0] if self.slicer.parts is not None else 1

    def hash_blocks(self, blocks: Sequence[int], heads: Heads) -> np.ndarray:
        """``[len(blocks), units(heads)]`` uint64: the hash of each block's each head."""
        out = np.empty((len(blocks), self.units(heads)), dtype=np.uint64)
        if self.slicer.parts is None:
            for i, block in enumerate(blocks):
                raw = self.kv_cache[block].reshape(-1).view(torch.uint8).cpu()
                out[i, 0] = digest(raw.numpy())
            return out
        a, b = heads[0] - self.held[0], heads[1] - self.held[0]
        k = b - a
        parts = [p[:, :, :, :, a:b] for p in self.slicer.parts]  # byte views [n, L, 2, B, k, X]
        sizes = [p[0].numel() // k for p in parts]
        # one block's heads, head-major: row j is head j's bytes of every part, back to back
        gathered = torch.empty((k, sum(sizes)), dtype=torch.uint8)
        targets, offset = [], 0
        for p, size in zip(parts, sizes, strict=True):
            layers, two, block_size, _, x = p.shape[1:]
            view = gathered[:, offset : offset + size].view(k, layers, two, block_size, x)
            targets.append(view)
            offset += size
        rows = gathered.numpy()
        for i, block in enumerate(blocks):
            for target, p in zip(targets, parts, strict=True):
                target.copy_(p[block].permute(3, 0, 1, 2, 4))
            for j in range(k):
                out[i, j] = digest(rows[j])
        return out

    def verify(
        self, runs: Sequence[Sequence[int]], heads: Heads, want: np.ndarray, peer: str
    ) -> None:
        """Hash the landed blocks of ``runs`` (``(dst_start, count)``) and compare with ``want``
        (what the server sent, by block in run order); raise KVChecksumError on any difference."""
        blocks = run_blocks(runs)
        got = self.hash_blocks(blocks, heads)
        if got.shape != want.shape:
            raise KVChecksumError(f"{peer} sent {want.shape} checksums for {got.shape} units")
        bad = np.argwhere(got != want)
        if len(bad):
            i, j = (int(x) for x in bad[0])
            head = heads[0] + j if self.slicer.parts is not None else "all"
            raise KVChecksumError(
                f"KV from {peer} failed its checksum: {len(bad)} of {got.size} (block, head) "
                f"hashes differ, first at block {blocks[i]} head {head}"
            )


@dataclass
class LeaseSums:
    """The hashes a server took of a lease's blocks when it was added, every head held here."""

    index: dict[int, int]  # block id -> row
    heads: Heads
    table: np.ndarray  # [blocks, units of held heads] uint64

    def select(self, blocks: Sequence[int], heads: Heads, per_head: bool) -> np.ndarray:
        rows = [self.index[b] for b in blocks]
        if not per_head:
            return np.ascontiguousarray(self.table[rows])
        return np.ascontiguousarray(
            self.table[rows, heads[0] - self.heads[0] : heads[1] - self.heads[0]]
        )


def hash_lease(hasher: KVHasher, lease: Any) -> None:
    """Start hashing a new lease's blocks in a thread: ``lease.checksums`` is the task (or the
    sums themselves, outside an event loop)."""
    blocks, heads = list(lease.block_ids), hasher.held

    def work() -> LeaseSums:
        table = hasher.hash_blocks(blocks, heads)
        return LeaseSums({b: i for i, b in enumerate(blocks)}, heads, table)

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        lease.checksums = work()
        return
    task = loop.create_task(asyncio.to_thread(work))
    task.add_done_callback(retrieve)
    lease.checksums = task


async def lease_sums(
    hasher: KVHasher, lease: Any, runs: Sequence[Sequence[int]], heads: Heads
) -> np.ndarray:
    """The hashes to send for a pull of ``runs`` (source ids) and ``heads``: those taken at lease
    time, or taken now when the lease was not hashed."""
    blocks = run_blocks(runs)
    sums = lease.checksums
    if sums is None:
        return await asyncio.to_thread(hasher.hash_blocks, blocks, heads)
    if isinstance(sums, asyncio.Future):
        sums = await asyncio.shield(sums)
    return sums.select(blocks, heads, hasher.slicer.parts is not None)
