"""Legs migrated away from a worker, remembered so they can be cancelled there again.

A leg that migrates is cancelled on the worker it leaves at once; a worker that was not really
gone (a partition, a reconnect of its bus) may not have heard that cancel, so the leg is kept
here until its deadline and cancelled again when that worker is heard from.
"""

from __future__ import annotations

import time

MAX_ABANDONED = 4096  # legs remembered at most; the oldest are forgotten first


class AbandonedLegs:
    """Bus ids of legs migrated away, each with the worker it left and its deadline."""

    def __init__(self, limit: int = MAX_ABANDONED) -> None:
        self.limit = limit
        self._legs: dict[str, tuple[str, float]] = {}

    def add(self, worker_id: str, bus_id: str, deadline: float) -> None:
        self._legs[bus_id] = (worker_id, deadline)
        while len(self._legs) > self.limit:
            del self._legs[next(iter(self._legs))]

    def to_cancel(self, worker_id: str | None) -> list[str]:
        """The legs to cancel again on ``worker_id`` (None: on every worker); those past their
        deadline are forgotten, their worker is done with them (see Leg.abandoned_until)."""
        now = time.time()
        due = []
        for bus_id, (worker, deadline) in list(self._legs.items()):
            if deadline < now:
                del self._legs[bus_id]
            elif worker_id is None or worker == worker_id:
                due.append(bus_id)
        return due
