"""Workers that leave or rejoin, and the gateway's own bus connection breaking, as the requests in
flight hear of them.

A worker leaving the registry (``LEFT``: gone for sure) is news to the requests that wait on it:
a prefill is retried elsewhere, decode legs migrate (``bus_request.py``). A worker whose own NATS
connection broke says so when it is back (``REJOINED``): what it was sent or sent meanwhile may
be lost, so its requests are told as well (``WorkerRejoined``). When the gateway's own connection
breaks, anything published meanwhile may be lost (NATS core keeps nothing for a subscriber that
is away): after the reconnect every request is told (``BusReconnected``), and until the workers
are heard again on the new connection - which also means their subscriptions are back - new
messages go only to workers that have been, and a migration waits for one (``recovered``).

A leg migrated away from a worker is cancelled there at once; a worker that was not really gone
(a partition, a reconnect) may not have heard that cancel, so it is sent again when that worker
turns up (``abandoned_legs.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from pdserve.gateway.inflight.abandoned_legs import AbandonedLegs
from pdserve.gateway.inflight.faults import StageTimeout
from pdserve.gateway.inflight.outbox import Outbox
from pdserve.gateway.inflight.queue_items import (
    Addressee,
    BusReconnected,
    WorkerLeft,
    WorkerRejoined,
)
from pdserve.gateway.router import Router
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.discovery.worker_registry import JOINED, LEFT, REJOINED, WorkerRegistry

log = logging.getLogger(__name__)

# After a reconnect of our bus, how long (in registry timeouts) workers not heard since are
# skipped and a migration waits for a decode worker to be heard: past it, the registry knows.
RECOVERY_TIMEOUTS = 2.0
RECOVERY_POLL_SECONDS = 0.1  # only while recovering: how often the registry is looked at


class Departures:
    """Tells the requests in flight (``requests``: the dispatcher's, each once) of departures
    and reconnects, and knows which workers to skip while the gateway's bus recovers."""

    def __init__(
        self,
        bus: Bus,
        workers: WorkerRegistry,
        router: Router,
        outbox: Outbox,
        requests: Callable[[], list[Addressee]],
    ) -> None:
        self.bus = bus
        self.workers = workers
        self.router = router
        self.outbox = outbox
        self._requests = requests
        self.bus_epoch = 0  # reconnects of our bus so far
        self._reconnected: tuple[float, float] | None = None  # (time.time(), registry clock)
        # bus id -> (decode worker, deadline) of legs migrated away from that worker
        self._abandoned = AbandonedLegs()
        workers.add_listener(self._on_registry_event)
        bus.on_reconnect(self._on_reconnect)

    def _on_registry_event(self, event: str, load: WorkerLoad) -> None:
        # LEFT means gone for sure: a clean WorkerGone, a restart, or missed heartbeats that a
        # ping confirmed (a slow but live worker answers it and keeps its requests).
        if event == LEFT:
            for request in self._requests():
                if load.worker_id in request.watching:
                    request.put(WorkerLeft(load.worker_id))
        elif event == JOINED:
            # back after a partition? Cancels sent while it was away never reached it.
            self._cancel_abandoned(load.worker_id)
        elif event == REJOINED:  # its connection broke: what it was sent or sent may be lost
            self._cancel_abandoned(load.worker_id)
            for request in self._requests():
                if load.worker_id in request.watching:
                    request.put(WorkerRejoined(load.worker_id))

    async def _on_reconnect(self) -> None:
        self.bus_epoch += 1
        self._reconnected = (time.time(), self.workers.clock())
        requests = self._requests()
        log.warning("bus reconnected: %d request(s) check what may be lost", len(requests))
        for request in requests:
            request.put(BusReconnected(self.bus_epoch))
        self.outbox.spawn(self._cancel_abandoned_when_heard())

    # -- our bus connection recovering ---------------------------------------------------------

    def _recovery_over(self) -> bool:
        if self._reconnected is None:
            return True
        if time.time() - self._reconnected[0] > RECOVERY_TIMEOUTS * self.workers.timeout:
            self._reconnected = None
            return True
        return False

    def _unheard(self) -> set[str]:
        """Workers not heard since our last reconnect (their subscriptions may not be back)."""
        reconnected = self._reconnected
        if reconnected is None or self._recovery_over():
            return set()
        since = reconnected[1]
        return {w for w, entry in self.workers.entries.items() if entry.last_seen <= since}

    async def recovered(self, deadline: float) -> set[str]:
        """The workers to skip now: none, unless our bus connection broke lately. While it is
        down, wait for it; once it is back, wait (up to the recovery window) until a decode
        worker has been heard on it, and skip those not heard yet: NATS delivers nothing to a
        subscription that is not back yet. Also waits while no decode worker is routable but
        some are being pinged (silent, not yet confirmed gone: a starved event loop, say)."""
        while True:
            if self.bus.connected:
                recovering = not self._recovery_over()
                unheard = self._unheard()
                if any(w.worker_id not in unheard for w in self.router.serving("decode")):
                    return unheard
                if not recovering and not self._decode_suspects():
                    return unheard  # nobody to wait for: the caller finds no worker
            if time.time() >= deadline:
                raise StageTimeout("no decode worker was reachable before the request's deadline")
            await asyncio.sleep(RECOVERY_POLL_SECONDS)

    def _decode_suspects(self) -> bool:
        return any(e.load.role == "decode" for e in self.workers.suspects.values())

    # -- legs migrated away --------------------------------------------------------------------

    def abandon(self, worker_id: str, bus_id: str, deadline: float) -> None:
        """A leg migrates away from ``worker_id``: cancel it there (a worker that was not really
        gone frees its blocks), now and again if that worker turns up again."""
        self.outbox.spawn(self.outbox.cancel(bus_id))
        self._abandoned.add(worker_id, bus_id, deadline)

    def _cancel_abandoned(self, worker_id: str | None) -> None:
        for bus_id in self._abandoned.to_cancel(worker_id):
            self.outbox.spawn(self.outbox.cancel(bus_id))

    async def _cancel_abandoned_when_heard(self) -> None:
        """After a reconnect: cancel the abandoned legs again once workers are heard (the
        cancels sent right after the reconnect may have beaten their subscriptions back)."""
        with contextlib.suppress(StageTimeout):
            await self.recovered(time.time() + RECOVERY_TIMEOUTS * self.workers.timeout)
        self._cancel_abandoned(None)
