"""Cancels a worker remembers for a while, for the requests they overtook.

Cancels and requests travel on different subscriptions, so a cancel can arrive before the
request it cancels: the worker remembers it and drops that request when it comes. The memory is
short and bounded: the overtaking race takes milliseconds, and a client that reuses its
x-request-id for a retry must not find its new request cancelled.
"""

from __future__ import annotations

import time

CANCEL_MEMORY_SECONDS = 2.0
CANCEL_MEMORY = 100_000


class RecentCancels:
    def __init__(self) -> None:
        self._at: dict[str, float] = {}  # request id -> when (insertion ordered)

    def add(self, bus_id: str) -> None:
        """Remember a cancel of ``bus_id``; forget the ones past the memory's time or size."""
        now = time.monotonic()
        self._at[bus_id] = now
        while self._at:
            rid, at = next(iter(self._at.items()))
            if now - at < CANCEL_MEMORY_SECONDS and len(self._at) <= CANCEL_MEMORY:
                break
            del self._at[rid]

    def __contains__(self, bus_id: str) -> bool:
        """Whether ``bus_id`` was cancelled recently."""
        at = self._at.get(bus_id)
        return at is not None and time.monotonic() - at < CANCEL_MEMORY_SECONDS
