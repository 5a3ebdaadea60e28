"""Who is alive and how loaded: worker heartbeats and the gateway's live registry.

Workers run a ``HeartbeatPublisher``: a ``WorkerLoad`` on ``{ns}.load.{role}.{worker}`` every
``heartbeat_seconds`` (and at once after a NATS reconnect), a ``WorkerGone`` when they leave
cleanly, and an answer (their load) to a ping on ``{ns}.ping.{worker}``. A ``KVEventPublisher``
sends what enters and leaves their prefix cache on ``{ns}.kv.{worker}``, with a periodic full
snapshot. They may also register as a NATS micro service, so ``nats micro ls`` shows them.

The gateway runs a ``WorkerRegistry``: it keeps each worker's latest load and the block hashes
in its prefix cache. A worker whose heartbeats stop for ``timeout`` seconds stops being routable
at once, but is reported gone only when a ping confirms it: NATS answers "no responders" at once
for a process that died (kill -9 closes its connection), while a live worker that was merely
slow - a busy engine thread starving its event loop - answers late and keeps its requests.
Listeners hear about joins and departures, e.g. to fail the streams of a decode worker that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.errors import NoRespondersError

from shared.bus import Bus
from shared.protocol import (
    MAX_KV_EVENT_HASHES,
    KVEvents,
    ProtocolError,
    WorkerGone,
    WorkerLoad,
    decode_as,
    encode,
)

log = logging.getLogger("pdserve.discovery")

JOINED = "joined"
LEFT = "left"
# A silent worker is pinged before it is reported gone; a live one answers within this many
# multiples of the heartbeat timeout even when its event loop is starved.
CONFIRM_TIMEOUT_FACTOR = 2.0
KV_SNAPSHOT_SECONDS = 10.0  # a late-joining gateway knows a worker's whole cache within this

LoadFn = Callable[[], WorkerLoad]
Listener = Callable[[str, WorkerLoad], None]


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
    """Publishes a worker's prefix-cache changes every ``interval`` and a full snapshot every
    ``snapshot_seconds`` (and after a NATS reconnect, when messages may have been lost)."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        instance: str,
        block_size: int,
        drain: Callable[[], tuple[list[int], list[int]]],
        snapshot: Callable[[], list[int]],
        interval: float,
        snapshot_seconds: float = KV_SNAPSHOT_SECONDS,
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.instance = instance
        self.block_size = block_size
        self.drain = drain
        self.snapshot = snapshot
        self.interval = interval
        self.snapshot_seconds = snapshot_seconds
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
        """What to send now: a (multi-part) snapshot, or the delta split to the size limit."""
        n = MAX_KV_EVENT_HASHES
        if snapshot:
            self._last_snapshot = time.monotonic()
            hashes = self.snapshot()
            chunks = [hashes[i : i + n] for i in range(0, len(hashes), n)] or [[]]
            self.seq += 1
            return [
                self._msg(chunk, [], snapshot=True, part=i, parts=len(chunks))
                for i, chunk in enumerate(chunks)
            ]
        stored, removed = self.drain()
        out = []
        while stored or removed:
            self.seq += 1
            out.append(self._msg(stored[:n], removed[:n]))
            stored, removed = stored[n:], removed[n:]
        return out

    def _msg(self, stored: list[int], removed: list[int], **kw) -> KVEvents:
        return KVEvents(
            self.worker_id, self.instance, self.block_size, self.seq, stored, removed, **kw
        )

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


@dataclass
class Entry:
    load: WorkerLoad
    last_seen: float  # monotonic


@dataclass
class CachedBlocks:
    """The block hashes one worker incarnation holds in its prefix cache, as its events say."""

    instance: str
    block_size: int
    hashes: set[int] = field(default_factory=set)
    seq: int = 0
    # a snapshot being received part by part: (seq, next part expected, hashes so far)
    partial: tuple[int, int, set[int]] | None = None

    def apply(self, msg: KVEvents) -> None:
        if not msg.snapshot:
            self.hashes.difference_update(msg.removed)
            self.hashes.update(msg.stored)
            self.seq = msg.seq
            return
        if msg.part == 0:
            self.partial = (msg.seq, 0, set())
        if self.partial is None or self.partial[:2] != (msg.seq, msg.part):
            self.partial = None  # a part went missing: keep what we have until the next one
            return
        got = self.partial[2]
        got.update(msg.stored)
        self.partial = (msg.seq, msg.part + 1, got)
        if msg.part + 1 == msg.parts:
            self.hashes, self.partial, self.seq = got, None, msg.seq

    def prefix_hits(self, block_hashes: list[int]) -> int:
        """How many leading blocks of a prompt this worker holds (the chain stops at a miss,
        exactly like the worker's own lookup)."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


class WorkerRegistry:
    """The live set of workers as seen from their heartbeats, and what their caches hold."""

    def __init__(
        self,
        bus: Bus,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        confirm_timeout: float | None = None,
    ):
        self.bus = bus
        self.timeout = timeout
        self.confirm_timeout = (
            confirm_timeout if confirm_timeout is not None else CONFIRM_TIMEOUT_FACTOR * timeout
        )
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        # silent for ``timeout``: not routable, but not reported gone until a ping confirms it
        self.suspects: dict[str, Entry] = {}
        self.cached: dict[str, CachedBlocks] = {}  # worker id -> its prefix cache's blocks
        self._confirming: dict[str, asyncio.Task] = {}
        self._listeners: list[Listener] = []
        self._reaper: asyncio.Task | None = None

    def add_listener(self, listener: Listener) -> None:
        """``listener(JOINED|LEFT, load)``; called on the event loop, must not block."""
        self._listeners.append(listener)

    async def start(self) -> None:
        await self.bus.subscribe(
            self.bus.subjects.all_loads, self._on_message, (WorkerLoad, WorkerGone)
        )
        await self.bus.subscribe(self.bus.subjects.all_kv, self._on_kv_events, (KVEvents,))
        self._reaper = asyncio.create_task(self._reap_loop(), name="registry-reaper")

    async def stop(self) -> None:
        tasks = [t for t in (self._reaper, *self._confirming.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._confirming.clear()

    async def _on_message(self, msg: WorkerLoad | WorkerGone, headers: dict[str, str]) -> None:
        if isinstance(msg, WorkerGone):
            entry = self.entries.pop(msg.worker_id, None) or self.suspects.pop(msg.worker_id, None)
            if entry is not None:
                log.info("%s worker %s left", msg.role, msg.worker_id)
                self._left(entry.load)
            return
        self._heard(msg)

    def _heard(self, msg: WorkerLoad) -> None:
        """A heartbeat (or a ping's answer) from ``msg.worker_id``."""
        old = self.entries.get(msg.worker_id) or self.suspects.pop(msg.worker_id, None)
        task = self._confirming.pop(msg.worker_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if old is not None and old.load.instance != msg.instance:
            # restarted under the same id: its previous incarnation's requests are lost
            log.warning("%s worker %s restarted", msg.role, msg.worker_id)
            self.entries.pop(msg.worker_id, None)
            self._left(old.load)
            old = None
        self.entries[msg.worker_id] = Entry(msg, self.clock())
        if old is None:
            log.info("%s worker %s joined", msg.role, msg.worker_id)
            self._notify(JOINED, msg)

    async def _on_kv_events(self, msg: KVEvents, headers: dict[str, str]) -> None:
        entry = self.entries.get(msg.worker_id) or self.suspects.get(msg.worker_id)
        if entry is None or entry.load.instance != msg.instance:
            # Not (yet) known, or from a previous incarnation: a later snapshot catches up.
            return
        cached = self.cached.get(msg.worker_id)
        if cached is None or cached.instance != msg.instance:
            cached = self.cached[msg.worker_id] = CachedBlocks(msg.instance, msg.block_size)
        cached.apply(msg)

    def _left(self, load: WorkerLoad) -> None:
        self.cached.pop(load.worker_id, None)
        self._notify(LEFT, load)

    def _notify(self, event: str, load: WorkerLoad) -> None:
        for listener in self._listeners:
            try:
                listener(event, load)
            except Exception:
                log.exception("registry listener failed")

    def prune(self) -> None:
        """Stop routing to workers whose last heartbeat is older than ``timeout``; ping them."""
        now = self.clock()
        for worker_id, entry in list(self.entries.items()):
            if now - entry.last_seen > self.timeout:
                del self.entries[worker_id]
                try:
                    asyncio.get_running_loop()
                except RuntimeError:  # no loop to ping from (a synchronous caller): gone now
                    log.warning("%s worker %s timed out", entry.load.role, worker_id)
                    self._left(entry.load)
                    continue
                self.suspects[worker_id] = entry
                log.warning("%s worker %s missed its heartbeats", entry.load.role, worker_id)
                self._confirming[worker_id] = asyncio.ensure_future(self._confirm(entry))

    async def _confirm(self, entry: Entry) -> None:
        """Ping a silent worker: an answer makes it live again; none means it is gone."""
        load = entry.load
        answer = await self.ping(load.worker_id, self.confirm_timeout)
        if self._confirming.get(load.worker_id) is asyncio.current_task():
            del self._confirming[load.worker_id]
        if self.suspects.get(load.worker_id) is not entry:
            return  # a heartbeat or WorkerGone settled it meanwhile
        if answer is not None and answer.instance == load.instance:
            log.info("%s worker %s answered a ping: still alive", load.role, load.worker_id)
            self._heard(answer)
            return
        del self.suspects[load.worker_id]
        log.warning("%s worker %s is gone", load.role, load.worker_id)
        self._left(load)

    async def ping(self, worker_id: str, timeout: float) -> WorkerLoad | None:
        """The worker's load from a direct request, or None when nobody answers in time."""
        if not self.bus.connected:
            return None
        try:
            reply = await self.bus.nc.request(self.bus.subjects.ping(worker_id), b"", timeout)
            return decode_as(reply.data, WorkerLoad, max_bytes=self.bus.max_bytes)
        except (NoRespondersError, asyncio.TimeoutError, ProtocolError):
            return None
        except Exception as exc:  # nats-py's own timeout type, a closed connection...
            log.debug("ping of %s failed: %s", worker_id, exc)
            return None

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

    def cached_blocks(self, worker_id: str) -> CachedBlocks | None:
        """What the worker's prefix cache holds, as far as its events told us."""
        return self.cached.get(worker_id)

    def prefix_hits(self, worker_id: str, block_hashes: list[int]) -> int:
        """Leading blocks of a prompt (its chained block hashes) the worker's cache holds."""
        cached = self.cached.get(worker_id)
        return cached.prefix_hits(block_hashes) if cached is not None else 0
