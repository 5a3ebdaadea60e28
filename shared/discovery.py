"""Who is alive and how loaded: worker heartbeats and the gateway's live registry.

Workers run a ``HeartbeatPublisher``: a ``WorkerLoad`` on ``{ns}.load.{role}.{worker}`` every
``heartbeat_seconds`` (and at once after a NATS reconnect), a ``WorkerGone`` when they leave
cleanly. They may also register as a NATS micro service, so ``nats micro ls`` shows them.

The gateway runs a ``WorkerRegistry``: it keeps each worker's latest load and drops workers whose
heartbeats stop for ``timeout`` seconds (crash, kill -9, network split). Listeners hear about
joins and departures, e.g. to fail the streams of a decode worker that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.bus import Bus
from shared.protocol import WorkerGone, WorkerLoad

log = logging.getLogger("pdserve.discovery")

JOINED = "joined"
LEFT = "left"

LoadFn = Callable[[], WorkerLoad]
Listener = Callable[[str, WorkerLoad], None]


class HeartbeatPublisher:
    """Publishes ``load_fn()`` periodically until stopped."""

    def __init__(self, bus: Bus, load_fn: LoadFn, interval: float) -> None:
        self.bus = bus
        self.load_fn = load_fn
        self.interval = interval
        self._task: asyncio.Task | None = None
        self.published = 0

    async def start(self) -> None:
        await self.publish_now()
        self.bus.on_reconnect(self.publish_now)  # be routable again as soon as NATS is back
        self._task = asyncio.create_task(self._loop(), name="heartbeat")

    async def publish_now(self) -> None:
        load = self.load_fn()
        load.ts = time.time()
        try:
            await self.bus.publish(self.bus.subjects.load(load.role, load.worker_id), load)
            self.published += 1
        except Exception as exc:  # disconnected: the next beat tries again
            log.debug("heartbeat not published: %s", exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.publish_now()

    async def stop(self, gone: bool = True) -> None:
        """Stop beating; with ``gone`` tell registries to drop this worker now."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if gone:
            load = self.load_fn()
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    self.bus.subjects.load(load.role, load.worker_id),
                    WorkerGone(load.worker_id, load.role),
                )
                await self.bus.flush()


async def register_micro_service(bus: Bus, load_fn: LoadFn, version: str = "0.1.0") -> object:
    """Register this worker as a NATS micro service (``pdserve-prefill``/``pdserve-decode``)
    with a ``load`` endpoint answering JSON. Returns the service (``await svc.stop()``)."""
    from nats.micro import add_service

    load = load_fn()
    service = await add_service(
        bus.nc,
        name=f"pdserve-{load.role}",
        version=version,
        description=f"pdserve {load.role} worker",
        metadata={"worker_id": load.worker_id, "model": load.model[:200]},
    )

    async def on_load(request) -> None:
        await request.respond(json.dumps(dataclasses.asdict(load_fn())).encode())

    await service.add_endpoint(
        name="load",
        subject=f"{bus.subjects.namespace}.status.{load.worker_id}",
        handler=on_load,
    )
    return service


@dataclass
class Entry:
    load: WorkerLoad
    last_seen: float  # monotonic


class WorkerRegistry:
    """The live set of workers as seen from their heartbeats."""

    def __init__(self, bus: Bus, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.bus = bus
        self.timeout = timeout
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self._listeners: list[Listener] = []
        self._reaper: asyncio.Task | None = None

    def add_listener(self, listener: Listener) -> None:
        """``listener(JOINED|LEFT, load)``; called on the event loop, must not block."""
        self._listeners.append(listener)

    async def start(self) -> None:
        await self.bus.subscribe(
            self.bus.subjects.all_loads, self._on_message, (WorkerLoad, WorkerGone)
        )
        self._reaper = asyncio.create_task(self._reap_loop(), name="registry-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    async def _on_message(self, msg: WorkerLoad | WorkerGone, headers: dict[str, str]) -> None:
        if isinstance(msg, WorkerGone):
            entry = self.entries.pop(msg.worker_id, None)
            if entry is not None:
                log.info("%s worker %s left", msg.role, msg.worker_id)
                self._notify(LEFT, entry.load)
            return
        old = self.entries.get(msg.worker_id)
        if old is not None and old.load.instance != msg.instance:
            # restarted under the same id: its previous incarnation's requests are lost
            log.warning("%s worker %s restarted", msg.role, msg.worker_id)
            del self.entries[msg.worker_id]
            self._notify(LEFT, old.load)
            old = None
        self.entries[msg.worker_id] = Entry(msg, self.clock())
        if old is None:
            log.info("%s worker %s joined", msg.role, msg.worker_id)
            self._notify(JOINED, msg)

    def _notify(self, event: str, load: WorkerLoad) -> None:
        for listener in self._listeners:
            try:
                listener(event, load)
            except Exception:
                log.exception("registry listener failed")

    def prune(self) -> None:
        """Drop workers whose last heartbeat is older than ``timeout``."""
        now = self.clock()
        for worker_id, entry in list(self.entries.items()):
            if now - entry.last_seen > self.timeout:
                del self.entries[worker_id]
                log.warning("%s worker %s timed out", entry.load.role, worker_id)
                self._notify(LEFT, entry.load)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.timeout / 4))
            self.prune()

    # -- queries (prune first, so a dead worker is never returned) ----------------------------

    def loads(self, role: str | None = None) -> list[WorkerLoad]:
        """Every live worker's latest load (draining ones included)."""
        self.prune()
        return [e.load for e in self.entries.values() if role is None or e.load.role == role]

    def routable(self, role: str) -> list[WorkerLoad]:
        """Live workers of ``role`` that take new requests."""
        return [load for load in self.loads(role) if not load.draining]

    def get(self, worker_id: str) -> WorkerLoad | None:
        self.prune()
        entry = self.entries.get(worker_id)
        return entry.load if entry else None
