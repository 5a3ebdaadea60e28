"""The host-memory tier: KV blocks evicted from the device pool, in one slab of block-sized slots
(pinned on CUDA, so copies both ways are DMA), least recently used first out.

Only the engine thread calls this, except ``release``: the disk thread hands back a slot whose
block it has written (a lock-free ``deque``, drained by the engine thread on its next store).

A slot is *pinned* while a copy out of it is pending: a load into the pool (claimed at admission,
unpinned once the copy is queued) or a write to disk (until the disk thread has written it). A
pinned slot is never reused, so nobody overwrites bytes still being read; the least recently
used unpinned entry makes room instead, and when every slot is pinned the new block is not kept.

With a disk tier behind, each block is written as it arrives (write-through, on the disk
thread): evicting a host entry then only forgets it, and what host memory held at a crash is on
disk too.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int, pinned: bool) -> None:
        self.block_bytes = block_bytes
        self.num_slots = max(0, capacity_bytes // block_bytes)
        # CPU: torch.empty touches no page, so memory is taken as blocks arrive. CUDA: pinned
        # up front (page-locked memory cannot be had lazily).
        self.slab = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.index: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.slot_hash: list[int | None] = [None] * self.num_slots
        self.pins = [0] * self.num_slots
        self.free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._released: deque[int] = deque()  # slots the disk thread is done with
        self.evicted: list[int] = []  # hashes forgotten since the owner last took them

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    def claim(self, block_hash: int) -> int | None:
        """Pin ``block_hash``'s slot for a load (None: not here); ``unpin`` once copied."""
        slot = self.index.get(block_hash)
        if slot is not None:
            self.index.move_to_end(block_hash)
            self.pins[slot] += 1
        return slot

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if self.pins[slot] == 0 and self.slot_hash[slot] is None:
            self.free.append(slot)

    def release(self, slot: int) -> None:
        """Unpin ``slot`` from any thread (the disk thread, once it wrote the block)."""
        self._released.append(slot)

    def store(self, block_hash: int) -> int | None:
        """A slot to copy ``block_hash``'s bytes into; None when it is here already (it is
        only touched) or every slot is pinned."""
        while self._released:
            self.unpin(self._released.popleft())
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return None
        if not self.free:
            self._evict_one()
        if not self.free:
            return None
        slot = self.free.pop()
        self.index[block_hash] = slot
        self.slot_hash[slot] = block_hash
        return slot

    def clear(self) -> list[int]:
        """Forget every entry (a reset); the hashes forgotten. A pinned slot is free once the
        copy out of it is done, as when its entry is evicted."""
        for slot in self.index.values():
            self.slot_hash[slot] = None
            if self.pins[slot] == 0:
                self.free.append(slot)
        forgotten = list(self.index)
        self.index.clear()
        return forgotten

    def _evict_one(self) -> None:
        """Forget the least recently used entry whose slot is not pinned."""
        victim = next((h for h, slot in self.index.items() if self.pins[slot] == 0), None)
        if victim is not None:
            slot = self.index.pop(victim)
            self.slot_hash[slot] = None
            self.evicted.append(victim)
            self.free.append(slot)
