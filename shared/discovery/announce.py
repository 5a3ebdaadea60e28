"""How a worker makes itself known (the gateway's side is ``pdserve.shared.discovery.worker_registry``).

A ``HeartbeatPublisher`` sends a ``WorkerLoad`` on ``{ns}.load.{role}.{worker}`` every
``heartbeat_seconds`` (and at once after a NATS reconnect), a ``WorkerGone`` when the worker
leaves cleanly, and answers a ping on ``{ns}.ping.{worker}`` with its load. A
``KVEventPublisher`` sends what enters and leaves the worker's prefix cache on
``{ns}.kv.{worker}``, with a periodic full snapshot. Workers may also register as a NATS micro
service, so ``nats micro ls`` shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.protocol import (
    MAX_KV_EVENT_HASHES,
    KVEvents,
    WorkerGone,
    WorkerLoad,
    encode,
)

log = logging.getLogger("pdserve.discovery")

KV_SNAPSHOT_SECONDS = 10.0  # a late-joining gateway knows a worker's whole cache within this

LoadFn = Callable[[], WorkerLoad]


class HeartbeatPublisher:
    """Publishes ``load_fn()`` periodically until stopped."""

    def __init__(self, bus: Bus, load_fn: LoadFn, interval: float) -> None:
        self.bus = bus
        self.load_fn = load_fn
        self.interval = interval
        self._task: asyncio.Task | None = None
        self._ping_sub = None
        self.published = 0

    async def start(self) -> None:
        load = self.load_fn()
        # Subscribed before the first beat, so a gateway never pings a worker it saw join in vain.
        self._ping_sub = await self.bus.nc.subscribe(
            self.bus.subjects.ping(load.worker_id), cb=self._on_ping
        )
        await self.publish_now()
        self.bus.on_reconnect(self.publish_now)  # be routable again as soon as NATS is back
        self._task = asyncio.create_task(self._loop(), name="heartbeat")

    async def _on_ping(self, msg) -> None:
        load = self.load_fn()
        load.ts = time.time()
        with contextlib.suppress(Exception):
            await msg.respond(encode(load))

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
        if self._ping_sub is not None:
            with contextlib.suppress(Exception):
                await self._ping_sub.unsubscribe()
            self._ping_sub = None
        if gone:
            load = self.load_fn()
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    self.bus.subjects.load(load.role, load.worker_id),
                    WorkerGone(load.worker_id, load.role),
                )
                await self.bus.flush()


class KVEventPublisher:
    """Publishes a worker's KV cache changes every ``interval`` and a full snapshot every
    ``snapshot_seconds`` (and after a NATS reconnect, when messages may have been lost), one
    stream per KV tier (``tiers``: the device pool, then the offload tiers the worker has).

    ``drain(tier)`` / ``snapshot(tier)`` give a tier's net change and contents; for the device
    tier they are called without an argument (so a plain pair of callables serves a worker
    without offload tiers)."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        instance: str,
        block_size: int,
        drain: Callable[..., tuple[list[int], list[int]]],
        snapshot: Callable[..., list[int]],
        interval: float,
        snapshot_seconds: float = KV_SNAPSHOT_SECONDS,
        tiers: tuple[str, ...] = ("device",),
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.instance = instance
        self.block_size = block_size
        self.drain = drain
        self.snapshot = snapshot
        self.interval = interval
        self.snapshot_seconds = snapshot_seconds
        self.tiers = tiers
        self.seq = 0
        self._last_snapshot = -float("inf")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.publish_now(snapshot=True)
        self.bus.on_reconnect(lambda: self.publish_now(snapshot=True))
        self._task = asyncio.create_task(self._loop(), name="kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            due = time.monotonic() - self._last_snapshot >= self.snapshot_seconds
            await self.publish_now(snapshot=due)

    def messages(self, snapshot: bool) -> list[KVEvents]:
        """What to send now: per tier, a (multi-part) snapshot, or the delta split to the size
        limit."""
        if snapshot:
            self._last_snapshot = time.monotonic()
        out: list[KVEvents] = []
        for tier in self.tiers:
            out += self._tier_messages(tier, snapshot)
        return out

    def _tier_messages(self, tier: str, snapshot: bool) -> list[KVEvents]:
        n = MAX_KV_EVENT_HASHES
        args = () if tier == "device" else (tier,)
        if snapshot:
            hashes = self.snapshot(*args)
            chunks = [hashes[i : i + n] for i in range(0, len(hashes), n)] or [[]]
            self.seq += 1
            return [
                self._msg(chunk, [], tier, snapshot=True, part=i, parts=len(chunks))
                for i, chunk in enumerate(chunks)
            ]
        stored, removed = self.drain(*args)
        out = []
        while stored or removed:
            self.seq += 1
            out.append(self._msg(stored[:n], removed[:n], tier))
            stored, removed = stored[n:], removed[n:]
        return out

    def _msg(self, stored: list[int], removed: list[int], tier: str, **kw) -> KVEvents:
        return KVEvents(
            self.worker_id, self.instance, self.block_size, self.seq, stored, removed,
            tier=tier, **kw,
        )  # fmt: skip

    async def publish_now(self, snapshot: bool = False) -> None:
        subject = self.bus.subjects.kv(self.worker_id)
        for msg in self.messages(snapshot):
            try:
                await self.bus.publish(subject, msg)
            except Exception as exc:  # disconnected: the snapshot after the reconnect repairs it
                log.debug("KV events not published: %s", exc)
                return


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
