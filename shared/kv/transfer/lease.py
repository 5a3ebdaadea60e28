"""Leases: the blocks a prefill worker holds for decode workers to pull (pure bookkeeping, no
UCX)."""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Lease:
    bus_id: str
    block_ids: list[int]
    num_tokens: int
    expires: float  # unix seconds
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    pins: int = 0  # transfers reading the blocks right now
    dropped: bool = False  # released or expired while pinned: free after the last transfer
    dropped_at: float = 0.0  # when (the table's clock): transfers still reading it end soon after
    on_drop: list[Callable[[], None]] = field(default_factory=list)  # pieces waiting on it
    checksums: Any = (
        None  # --kv-checksum: its blocks' hashes, or the task taking them (checksum.py)
    )
    block_set: frozenset[int] | None = None  # block_ids as a set, once a pull checks against it
    # a lease taken while prefill still writes its blocks: how far it got (stream.py)
    stream: Any = None
    # the highest generation among its blocks when leased; None where the table has no
    # generations to read (a TP rank's mirror: rank 0's server checks for the request)
    epoch: int | None = None
    # the LoRA adapter the KV was computed under (None: the base model): the handle says it,
    # and a decode worker refuses KV of another adapter than its request's
    lora: str | None = None


class LeaseTable:
    """Blocks a prefill worker holds for decode workers to pull.

    ``on_free(bus_id)`` is called exactly once per lease, when it is released or expired and
    no transfer is reading it; the worker then returns the blocks to its engine. The tokens of
    the last ``remember`` dropped leases are kept, so a late puller can be told its lease is gone
    without answering anyone who never held a token. ``on_add(lease)``, if set, sees each new
    lease (a KV server that hashes leased blocks sets it). Used from one event loop only.
    The prefill side's ``KVLeases`` (``shared/kv/contract.py``).
    """

    def __init__(
        self,
        on_free: Callable[[str], None],
        clock: Callable[[], float] = time.time,
        remember: int = 4096,
        generations: np.ndarray | None = None,
    ):
        self.on_free = on_free
        # The engine's block generations (block_manager.py), read when a lease is taken and
        # when it is pulled: a block whose generation rose past its lease's epoch was freed
        # and taken again, its KV overwritten - a pull of it is refused (``reused``), so a
        # leaked token or a lease the table kept by mistake can never serve another's KV.
        self.generations = generations
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.remember = remember
        # the last ``remember`` freed leases: (token, why a streamed one's prompt never
        # completed). A pull that comes after the blocks went back still hears that its request
        # finished at the first token, and drops it quietly instead of recomputing the prompt.
        self.dropped: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self.on_add: Callable[[Lease], None] | None = None

    def __len__(self) -> int:
        return len(self.leases)

    def count(self, prefix: str) -> int:
        """Leases held under ids starting with ``prefix`` (the doctor's probes, say)."""
        return sum(bus_id.startswith(prefix) for bus_id in self.leases)

    def add(
        self, bus_id: str, block_ids: list[int], num_tokens: int, ttl: float, stream: Any = None
    ) -> Lease:
        """Lease ``block_ids``; ``stream`` (a ``stream.LayerStream``) while prefill still writes
        them."""
        if bus_id in self.leases:
            raise ValueError(f"lease for {bus_id!r} exists")
        lease = Lease(
            bus_id=bus_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            expires=self.clock() + ttl,
            stream=stream,
            epoch=self.epoch_of(block_ids),
        )
        self.leases[bus_id] = lease
        if self.on_add is not None:
            self.on_add(lease)
        return lease

    def epoch_of(self, block_ids: list[int]) -> int | None:
        """The highest generation among ``block_ids`` now (None: no generations here)."""
        if self.generations is None:
            return None
        return int(self.generations[block_ids].max()) if block_ids else 0

    def reused(self, epoch: int, runs: list[tuple[int, int]]) -> bool:
        """Whether any block of ``runs`` ((start, count) each) was taken off the free list again
        since a lease of ``epoch`` was taken; False where there are no generations to read."""
        gens = self.generations
        if gens is None:
            return False
        return any(int(gens[start : start + count].max()) > epoch for start, count in runs)

    def get(self, bus_id: str) -> Lease | None:
        lease = self.leases.get(bus_id)
        return None if lease is None or lease.dropped else lease

    def token_of(self, bus_id: str) -> str | None:
        """The secret of a live or recently dropped lease."""
        lease = self.leases.get(bus_id)
        if lease is not None:
            return lease.token
        return self.dropped[bus_id][0] if bus_id in self.dropped else None

    def ended(self, bus_id: str) -> str | None:
        """Why a dropped streamed lease's prompt never completed (``stream.end``), while its
        token is remembered; None for any other lease."""
        lease = self.leases.get(bus_id)
        if lease is None:
            return self.dropped[bus_id][1] if bus_id in self.dropped else None
        return lease.stream.ended if lease.dropped and lease.stream is not None else None

    def release(self, bus_id: str) -> bool:
        """Drop a lease (pull done, cancel). False if there was none."""
        lease = self.leases.get(bus_id)
        if lease is None or lease.dropped:
            return False
        lease.dropped, lease.dropped_at = True, self.clock()
        for callback in list(lease.on_drop):
            callback()
        if lease.pins == 0:
            self._free(lease)
        return True

    def expire(self) -> list[str]:
        """Release every lease past its expiry; returns their request ids. A streamed lease's
        time starts when its prompt is complete (``restart``): until then prefill holds it."""
        now = self.clock()
        gone = [
            rid
            for rid, lease in self.leases.items()
            if not lease.dropped and lease.expires < now and not _being_written(lease)
        ]
        for rid in gone:
            log.info("lease of %s expired unpulled; freeing its blocks", rid)
            self.release(rid)
        return gone

    def restart(self, lease: Lease, ttl: float) -> None:
        """A streamed lease's prompt is complete: it expires ``ttl`` from now."""
        lease.expires = self.clock() + ttl

    def pin(self, lease: Lease) -> None:
        lease.pins += 1

    def unpin(self, lease: Lease) -> None:
        lease.pins -= 1
        if lease.pins == 0 and lease.dropped:
            self._free(lease)

    def _free(self, lease: Lease) -> None:
        if self.leases.pop(lease.bus_id, None) is not None:
            ended = lease.stream.ended if lease.stream is not None else None
            self.dropped[lease.bus_id] = (lease.token, ended)
            while len(self.dropped) > self.remember:
                self.dropped.popitem(last=False)
            self.on_free(lease.bus_id)


def _being_written(lease: Lease) -> bool:
    stream = lease.stream
    return stream is not None and not stream.complete and stream.ended is None
