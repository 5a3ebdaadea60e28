"""The tiers below the device pool, as the engine sees them: where a block hash is cached, claims
on blocks to load, stores of evicted blocks, and their counters.

The engine (``services/engine/offload.py``) calls all of this on its own thread. Copies between
the pool and host memory are queued on the current stream (non-blocking on CUDA, from and into
pinned slots); ``settle`` waits for the ones queued since its last call before anything else
may read those slots (the disk thread) or write the pool blocks they came from (a KV pull
over UCX), and only then posts the disk writes of the blocks host memory took since.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from pdserve.services.engine.kv_tiers.disk import DiskCounts, LoadDone
from pdserve.services.engine.kv_tiers.host import HostTier
from pdserve.services.engine.kv_tiers.tier_events import DISK, HOST, EventedDiskTier, TierEventLog


@dataclass
class Claim:
    """A block found in a tier and kept there until it is loaded into the pool."""

    block_hash: int
    tier: str
    slot: int = -1  # host memory: the slot holding it

    @property
    def slow(self) -> bool:
        """Loaded off the engine thread (disk I/O), so its sequence waits for it."""
        return self.tier == DISK


@dataclass
class TierStats:
    """Since start, in blocks (``host_blocks``/``disk_blocks``: held now)."""

    host_hits: int = 0  # prefix blocks found in host memory and loaded from there
    disk_hits: int = 0  # ... found on disk
    stored: int = 0  # evicted pool blocks copied to host memory
    dropped: int = 0  # evicted pool blocks not kept (every host slot busy)
    to_disk: int = 0  # host blocks posted to disk (write-through; it skips those it has)
    load_failures: int = 0  # disk loads that failed (those tokens were computed instead)
    host_blocks: int = 0
    disk_blocks: int = 0
    disk: DiskCounts = field(default_factory=DiskCounts)
    # measured: loading a block from host memory / disk over computing it (load_cost.py; 0: not)
    host_load_cost: float = 0.0
    disk_load_cost: float = 0.0


class KVTiers:
    def __init__(
        self,
        block_bytes: int,
        layout: str,
        ram_bytes: int,
        device: torch.device,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        weights: Callable[[], str] | None = None,  # the disk files' weights digest (disk.py)
        shards: int = 1,  # TP ranks: ``block_bytes`` is one rank's shard of a block
    ) -> None:
        self.block_bytes = block_bytes
        self.device = device
        self.cuda = device.type == "cuda"
        # each rank holds its shard of every slot, so ``ram_bytes`` buys a slot per whole block
        self.host = HostTier(ram_bytes // shards, block_bytes, pinned=self.cuda)
        self.log = TierEventLog()  # what the tiers hold, for the KV event stream
        self.disk = (
            EventedDiskTier(
                disk_dir, disk_bytes, block_bytes * shards, layout, weights, log=self.log
            )
            if disk_dir
            else None
        )
        # TP: has the other ranks copy what this rank did since the last call and returns
        # their shards of the slots asked for, rank 1's first (services/engine/offload.py)
        self.ranks_sync: Callable[[list[int]], list[list[np.ndarray]]] | None = None
        self.counts = TierStats()
        self._writes: list[tuple[int, int]] = []  # (hash, slot) to post once copies settled
        self._unsettled = False  # copies queued on the stream since the last settle

    @property
    def names(self) -> tuple[str, ...]:
        return (HOST, DISK) if self.disk is not None else (HOST,)

    def enable_events(self) -> None:
        """Start recording tier events in ``log``, seeded with what the tiers hold (the engine
        thread, or before it runs)."""
        if self.disk is not None:
            self.disk.enable_events()
        self.log.enabled = True
        self.log.add(HOST, True, list(self.host.index))

    def where(self, block_hash: int) -> str | None:
        if block_hash in self.host:
            return HOST
        if self.disk is not None and block_hash in self.disk:
            return DISK
        return None

    def claim(self, block_hash: int) -> Claim | None:
        """Keep ``block_hash`` where it is until it is loaded (``load_host``/``load_disk``)."""
        slot = self.host.claim(block_hash)
        if slot is not None:
            self.counts.host_hits += 1
            return Claim(block_hash, HOST, slot)
        if self.disk is not None and self.disk.claim(block_hash):
            self.counts.disk_hits += 1
            return Claim(block_hash, DISK)
        return None

    def store(self, block_hash: int, src: torch.Tensor) -> int | None:
        """Copy an evicted pool block (``src``: its bytes) to host memory, unless it is there;
        the slot it went to (None: not copied)."""
        slot = self.host.store(block_hash)
        if self.host.evicted:
            self.log.add(HOST, False, self.host.evicted)
            self.host.evicted = []
        if slot is not None:
            self.log.add(HOST, True, (block_hash,))
        if slot is None:
            self.counts.dropped += block_hash not in self.host
            return None
        self.host.slab[slot].copy_(src, non_blocking=self.cuda)
        self._unsettled |= self.cuda
        self.counts.stored += 1
        if self.disk is not None:
            self.host.pin(slot)  # until the disk thread has written it
            self._writes.append((block_hash, slot))
        return slot

    def load_host(self, claim: Claim, dst: torch.Tensor) -> None:
        """Copy a claimed host block into a pool block (``dst``: its bytes)."""
        dst.copy_(self.host.slab[claim.slot], non_blocking=self.cuda)
        self._unsettled |= self.cuda
        self.host.unpin(claim.slot)

    def load_disk(self, claims: list[Claim], done: LoadDone) -> None:
        """Read claimed disk blocks on the disk thread; ``done`` gets them there."""
        assert self.disk is not None

        def finished(blocks: list[np.ndarray] | None, error: str) -> None:
            self.counts.load_failures += blocks is None
            done(blocks, error)

        self.disk.load([c.block_hash for c in claims], finished)

    def settle(self) -> None:
        """Wait for the copies queued so far (at TP, every rank's), then post the disk writes
        waiting for them."""
        if self._unsettled:
            torch.cuda.current_stream(self.device).synchronize()
            self._unsettled = False
        writes, self._writes = self._writes, []
        slots = [slot for _, slot in writes]
        shards = self.ranks_sync(slots) if self.ranks_sync is not None else []
        for i, (block_hash, slot) in enumerate(writes):
            assert self.disk is not None  # nothing is written without one
            payload = self.host.slab[slot].numpy()
            if shards:  # a file holds the ranks' shards in rank order
                payload = np.concatenate([payload, *(rank[i] for rank in shards)])

            def written(slot: int = slot, block_hash: int = block_hash) -> None:
                self.host.release(slot)
                self.disk.written(block_hash)  # stored on disk (the event), unless it failed

            self.disk.put(block_hash, payload, written)
        self.counts.to_disk += len(writes)

    def clear(self) -> int:
        """Forget every block of every tier (``POST /reset_prefix_cache?reset_external=true``);
        how many blocks were held. Writes not posted yet are dropped with their blocks."""
        for _, slot in self._writes:
            self.host.unpin(slot)
        self._writes = []
        host = self.host.clear()
        self.log.add(HOST, False, host)
        disk = self.disk.clear() if self.disk is not None else []
        return len(set(host) | set(disk))

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        if self.disk is None:
            return replace(self.counts, host_blocks=len(self.host))
        return replace(
            self.counts,
            host_blocks=len(self.host),
            disk_blocks=len(self.disk),
            disk=replace(self.disk.counts),
        )

    def flush(self) -> None:
        """Post what waits and wait for the disk tier's jobs so far (its start-up scan too)."""
        self.settle()
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Post what waits, then stop the disk thread once its jobs ran (every block host
        memory took is on disk then: a restart finds it)."""
        self.settle()
        if self.disk is not None:
            self.disk.close()
