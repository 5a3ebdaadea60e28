"""Who is alive and how loaded, as the gateway sees it (the workers' side is
``pdserve.shared.discovery.announce``).

The gateway runs a ``WorkerRegistry``: it keeps each worker's latest load and the block hashes
in its prefix cache. A worker whose heartbeats stop for ``timeout`` seconds stops being routable
at once, but is reported gone only when a ping confirms it: NATS answers "no responders" at once
for a process that died (kill -9 closes its connection), while a live worker that was merely
slow - a busy engine thread starving its event loop - answers late and keeps its requests.
Silence is judged only while our own connection is up, counted from our latest reconnect, and
a worker that does not answer its ping is gone only if our own server answers one: a gateway
cut off from NATS hears nobody, which says nothing about the workers.
Listeners hear about joins and departures, e.g. to fail the streams of a decode worker that died,
and about a worker whose own connection broke and is back (``REJOINED``: it kept its requests,
but what it sent or was sent meanwhile may be lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.errors import NoRespondersError

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import KV_TIERS, KVEvents, WorkerGone, WorkerLoad
from pdserve.shared.bus.protocol import ProtocolError, decode_as

log = logging.getLogger(__name__)

JOINED = "joined"
LEFT = "left"
REJOINED = "rejoined"  # WorkerGone(rejoining=True): its connection broke and is back
# A silent worker is pinged before it is reported gone; a live one answers within this many
# multiples of the heartbeat timeout even when its event loop is starved.
CONFIRM_TIMEOUT_FACTOR = 2.0

Listener = Callable[[str, WorkerLoad], None]


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
        if msg.cleared:  # AllBlocksCleared: the tier is empty, then this message's delta applies
            self.hashes, self.partial = set(), None
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


def tier_chain(tiers: dict[str, CachedBlocks], block_hashes: list[int]) -> list[str]:
    """For each leading block of a prompt, the fastest tier holding it (``KV_TIERS`` order);
    the chain stops at the first block no tier holds, as the worker's own lookup does (it goes
    on in the tiers where its pool's blocks end)."""
    order = [tiers[t] for t in KV_TIERS if t in tiers]
    chain = []
    for h in block_hashes:
        held = next((c for c in order if h in c.hashes), None)
        if held is None:
            break
        chain.append(next(t for t in KV_TIERS if tiers.get(t) is held))
    return chain


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
        # worker id -> KV tier -> the blocks that tier holds (device: its prefix cache)
        self.cached: dict[str, dict[str, CachedBlocks]] = {}
        self._confirming: dict[str, asyncio.Task] = {}
        self._listeners: list[Listener] = []
        self._reaper: asyncio.Task | None = None
        self._back = -math.inf  # clock() at our latest reconnect: silence counts from there

    def add_listener(self, listener: Listener) -> None:
        """``listener(JOINED|LEFT|REJOINED, load)``; called on the event loop, must not block."""
        self._listeners.append(listener)

    async def start(self) -> None:
        await self.bus.subscribe(
            self.bus.subjects.all_loads, self._on_message, (WorkerLoad, WorkerGone)
        )
        await self.bus.subscribe(self.bus.subjects.all_kv, self._on_kv_events, (KVEvents,))
        self.bus.on_reconnect(self._on_reconnect)
        self._reaper = asyncio.create_task(self._reap_loop(), name="registry-reaper")

    async def stop(self) -> None:
        tasks = [t for t in (self._reaper, *self._confirming.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._confirming.clear()

    async def _on_reconnect(self) -> None:
        self._back = self.clock()

    async def _on_message(self, msg: WorkerLoad | WorkerGone, headers: dict[str, str]) -> None:
        if isinstance(msg, WorkerGone) and msg.rejoining:
            entry = self.entries.get(msg.worker_id) or self.suspects.get(msg.worker_id)
            if entry is not None:  # else its next heartbeat makes it join
                log.info("%s worker %s reconnected to NATS", msg.role, msg.worker_id)
                self.cached.pop(msg.worker_id, None)  # events may be lost: its next snapshot
                self._notify(REJOINED, entry.load)
            return
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
        tiers = self.cached.setdefault(msg.worker_id, {})
        cached = tiers.get(msg.tier)
        if cached is None or cached.instance != msg.instance:
            if any(c.instance != msg.instance for c in tiers.values()):
                tiers.clear()  # a new incarnation: what the old one held is gone
            cached = tiers[msg.tier] = CachedBlocks(
                instance=msg.instance, block_size=msg.block_size
            )
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
        if self.bus is not None and not self.bus.connected:
            return  # we hear nobody now: their silence says nothing
        now = self.clock()
        for worker_id, entry in list(self.entries.items()):
            if now - max(entry.last_seen, self._back) > self.timeout:
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
        asked = self.clock()
        # The silence may be ours (our server unreachable, our connection not yet seen broken):
        # a partition once made a gateway report every worker gone. So our own server must
        # answer within half the ping's time as it leaves (the worker then has the other half),
        # and again once it is over: a ping that sat in a dead link until its time ran out says
        # nothing, even if the link is back by then.
        before = asyncio.ensure_future(self.bus.answers(self.confirm_timeout / 2))
        try:
            answer = await self.ping(load.worker_id, self.confirm_timeout)
            ours = await before
        finally:
            before.cancel()
        if answer is None and ours:
            ours = await self.bus.answers(self.confirm_timeout)
        if self._confirming.get(load.worker_id) is asyncio.current_task():
            del self._confirming[load.worker_id]
        if self.suspects.get(load.worker_id) is not entry:
            return  # a heartbeat or WorkerGone settled it meanwhile
        if answer is None and (not ours or not self.bus.connected or self._back > asked):
            # our own connection is or was broken meanwhile: no verdict; silence counts from
            # our reconnect
            self.entries[load.worker_id] = self.suspects.pop(load.worker_id)
            return
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
        except ProtocolError as exc:
            self.bus.count_rejected(self.bus.subjects.ping(worker_id), exc)
            return None
        except (NoRespondersError, asyncio.TimeoutError):
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
        """Live workers of ``role`` that take new requests (not draining, not on standby)."""
        return [load for load in self.loads(role) if not (load.draining or load.standby)]

    def get(self, worker_id: str) -> WorkerLoad | None:
        self.prune()
        entry = self.entries.get(worker_id)
        return entry.load if entry else None

    def cached_blocks(self, worker_id: str, tier: str = "device") -> CachedBlocks | None:
        """What one KV tier of the worker holds (device: its prefix cache), as far as its
        events told us."""
        return self.cached.get(worker_id, {}).get(tier)

    def prefix_hits(self, worker_id: str, block_hashes: list[int]) -> int:
        """Leading blocks of a prompt (its chained block hashes) the worker's device pool
        holds."""
        cached = self.cached_blocks(worker_id)
        return cached.prefix_hits(block_hashes) if cached is not None else 0

    def tier_chain(self, worker_id: str, block_hashes: list[int]) -> list[str]:
        """Per leading block of a prompt, the fastest of the worker's tiers holding it."""
        return tier_chain(self.cached.get(worker_id, {}), block_hashes)
