"""KV offload tiers at tensor parallelism: every rank keeps its own shard of each tier block,
rank 0 keeps everything else (``services/engine/offload.py``).

Rank 0's ``KVTiers`` decide alone - the host-memory slots and their LRU, the disk index, the
claims, the events - as at TP 1. Each rank holds a host slab with the same slots, of its own
shard's bytes, so the slots' copies to and from the pool run on every rank in parallel and no
KV crosses between ranks while it stays in host memory. A block's disk file holds every rank's
shard, in rank order (the layout fingerprint names the TP size, so another TP size never reads
it): the ranks hand rank 0 their shard of a slot when it is written, and rank 0 hands each rank
its shard of a block read back.

Rank 0 records what this step's tier work asks of the ranks (``TierLog``) and sends it in one
message per rank at the end of the scheduler's pass (``RankGroup.sync_tiers``), which each rank
applies in order and answers (``RankTiers``). The answer is waited for: by then every rank has
copied the blocks the pass evicted, so neither a KV pull into one of them (on the rank's KV
agent thread, ``kv_agent.py``) nor the step's forward pass can overwrite it first, and rank 0
has the shards it writes to disk. The message goes ahead of the step's inputs on the same
connection, so the loads land before the forward pass reads them.

A probe's held block (``services/probe.py``) moves rank 0's heads only, so nothing the ranks
copy can race it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# (op, pool block, slot): "store" copies a pool block into a slot, "load" a slot into a block
Copy = tuple[str, int, int]


@dataclass
class TierOps:
    """One rank's tier work of a step, applied in order: ``puts`` (blocks read from disk: its
    shard of each), then ``copies``, then the slots in ``gather`` are answered with."""

    num_slots: int  # the host slab's slots (the same on every rank)
    puts: list[tuple[int, np.ndarray]] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    gather: list[int] = field(default_factory=list)


class TierLog:
    """Rank 0's record of what the other ranks must do, in the order rank 0 did it."""

    def __init__(self, ranks: int, num_slots: int, shard_bytes: int) -> None:
        self.ranks = ranks  # the other ranks: 1 .. ranks
        self.num_slots = num_slots
        self.shard_bytes = shard_bytes
        self._puts: list[tuple[int, np.ndarray]] = []
        self._copies: list[Copy] = []

    def __bool__(self) -> bool:
        return bool(self._puts or self._copies)

    def store(self, block_id: int, slot: int) -> None:
        self._copies.append(("store", block_id, slot))

    def load(self, slot: int, block_id: int) -> None:
        self._copies.append(("load", block_id, slot))

    def put(self, block_id: int, data: np.ndarray) -> None:
        """A whole block read from disk (every rank's shard): each rank copies in its own."""
        self._puts.append((block_id, data))

    def take(self, gather: list[int]) -> list[TierOps]:
        """Each rank's ops (rank 1 first), recorded since the last take."""
        puts, self._puts = self._puts, []
        copies, self._copies = self._copies, []
        step = self.shard_bytes
        return [
            TierOps(
                num_slots=self.num_slots,
                puts=[(block, data[r * step : (r + 1) * step]) for block, data in puts],
                copies=copies,
                gather=gather,
            )
            for r in range(1, self.ranks + 1)
        ]


class RankTiers:
    """A rank's host slab, driven by rank 0's ``TierOps``."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.raw = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)  # each block's bytes
        self.cuda = kv_cache.device.type == "cuda"
        self.slab: torch.Tensor | None = None  # made on the first ops: rank 0 sizes it

    def apply(self, ops: TierOps) -> list[np.ndarray]:
        """Do ``ops``; the gathered slots' bytes (views: the caller sends them at once)."""
        if self.slab is None:
            self.slab = torch.empty(
                (ops.num_slots, self.raw.shape[1]), dtype=torch.uint8, pin_memory=self.cuda
            )
        for block_id, data in ops.puts:
            self.raw[block_id].copy_(torch.from_numpy(data))
        for op, block_id, slot in ops.copies:
            if op == "store":
                self.slab[slot].copy_(self.raw[block_id], non_blocking=self.cuda)
            else:
                self.raw[block_id].copy_(self.slab[slot], non_blocking=self.cuda)
        if self.cuda:  # the stores are in the slab before anyone may write their blocks
            torch.cuda.current_stream(self.raw.device).synchronize()
        return [self.slab[slot].numpy() for slot in ops.gather]
