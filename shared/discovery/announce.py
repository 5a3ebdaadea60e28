"""How a worker makes itself known (the gateway's side is ``pdserve.shared.discovery.worker_registry``).

A ``HeartbeatPublisher`` sends a ``WorkerLoad`` on ``{ns}.load.{role}.{worker}`` every
``heartbeat_seconds`` (and at once after a NATS reconnect), a ``WorkerGone`` when the worker
leaves cleanly, and answers a ping on ``{ns}.ping.{worker}`` with its load. A
``KVEventPublisher`` (``kv_publisher.py``) sends what enters and leaves the worker's KV tiers
on ``{ns}.kv.{worker}``, with a periodic full snapshot. Workers may also register as a NATS micro
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
from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.bus.protocol import encode
from pdserve.shared.discovery.kv_publisher import (  # noqa: F401 (its home before; importers)
    KV_SNAPSHOT_SECONDS,
    KVEventPublisher,
)

log = logging.getLogger(__name__)

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
                    WorkerGone(worker_id=load.worker_id, role=load.role),
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
