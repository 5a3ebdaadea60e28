"""What the offload tiers hold, as events for the worker's KV event stream (issue 33).

Each event is ``(tier, stored, block hash)``: ``stored`` False is a removal. Host memory's come
from the engine thread (a block stored from the pool, an LRU entry forgotten); the disk's from
the disk thread (a file written, a file found corrupt or unreadable) and from the engine thread
(files evicted over capacity, when a write is posted). All of them go into one ``deque`` (its
appends are atomic), which the consumer drains on its own thread, as the worker's event loop
does with the pool's events: neither thread waits for the other.

Nothing is recorded until a consumer ``enable``s the log (an engine without a worker around it
would only grow it); enabling seeds it with what the tiers hold at that moment, so a consumer's
picture built from events alone matches the tiers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from pdserve.services.engine.kv_tiers.disk import DiskTier

HOST, DISK = "host", "disk"
TierEvent = tuple[str, bool, int]  # (tier, stored (else removed), block hash)


class TierEventLog:
    def __init__(self) -> None:
        self.enabled = False
        self.events: deque[TierEvent] = deque()

    def add(self, tier: str, stored: bool, hashes: Iterable[int]) -> None:
        if self.enabled:
            self.events.extend((tier, stored, h) for h in hashes)

    def take(self) -> list[TierEvent]:
        """Everything recorded so far, oldest first (any one thread)."""
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out


class EventedDiskTier(DiskTier):
    """The disk tier telling a ``TierEventLog`` what it holds: a block counts as stored once its
    file is written (a restart would find it), as removed when its file is evicted, found
    corrupt or cannot be written or read."""

    def __init__(self, *args, log: TierEventLog, **kw) -> None:
        self.log = log  # before the base class starts its thread (the scan runs there)
        super().__init__(*args, **kw)

    def enable_events(self) -> None:
        """Start recording, seeded with every block indexed now (atomically: under the lock
        the disk thread takes before it changes the index)."""
        with self._lock:
            self.log.enabled = True
            self.log.add(DISK, True, list(self._index))

    def written(self, block_hash: int) -> None:
        """The disk thread finished a write of ``block_hash`` (failed: it is forgotten)."""
        if threading.current_thread() is not self._thread:
            # ``put`` skipped it (on disk already: its event is out or comes with its write;
            # or too big to keep), calling back at once on the engine thread, under the lock
            return
        with self._lock:
            if block_hash in self._index:
                self.log.add(DISK, True, (block_hash,))

    def clear(self) -> list[int]:
        gone = super().clear()
        self.log.add(DISK, False, gone)
        return gone

    def _evict_over_capacity(self) -> list[int]:  # under the lock
        evicted = super()._evict_over_capacity()
        self.log.add(DISK, False, evicted)
        return evicted

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            known = block_hash in self._index
        super()._forget(block_hash)
        if known:
            self.log.add(DISK, False, (block_hash,))

    def _scan(self) -> None:
        super()._scan()
        with self._lock:  # what the scan indexed (the seed, when enabled before it ran)
            self.log.add(DISK, True, list(self._index))
