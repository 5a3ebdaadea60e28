"""A worker's KV event stream on NATS: ``KVEvents`` on ``{ns}.kv.{worker}`` (issue 33).

Every ``interval`` the publisher collects each KV tier's net change (``KVDelta``: stored and
removed hashes, a clear, the stored blocks' lineage) and sends it; every ``snapshot_seconds``
(and after a NATS reconnect, when messages may have been lost) it sends each tier's whole
contents instead, which replace what a gateway knew. Listeners (the vLLM-format ZMQ stream,
``vllm_kv_events.py``) get the same messages before they go to NATS, on the event loop.

Messages stay under NATS's default 1 MB payload: at most ``MAX_KV_EVENT_HASHES`` hashes in all
(stored, their parents, removed; 9 msgpack bytes each) and ``MAX_KV_EVENT_TOKENS`` token ids
(5 bytes at most) per message, and at most ``MAX_ADAPTERS`` LoRA adapter names (a block
computed under one names it by index: a byte); bigger changes are split. A message's lineage is
all of its stored blocks' or none, so blocks without one (disk blocks indexed at start) go
apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from itertools import chain

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import MAX_ADAPTERS, KVEvents
from pdserve.shared.bus.wire_fields import MAX_KV_EVENT_HASHES, MAX_KV_EVENT_TOKENS
from pdserve.shared.discovery.kv_delta import KVDelta, Lineage

log = logging.getLogger(__name__)

KV_SNAPSHOT_SECONDS = 10.0  # a late-joining gateway knows a worker's whole cache within this

# gets every batch of messages about to be published (on the event loop; must not block)
Listener = Callable[[list[KVEvents]], None]


def _lineage_chunks(known: list[int], lineage: dict[int, Lineage], size: int) -> list[list[int]]:
    """``known`` cut into messages' chunks of at most ``size`` blocks and ``MAX_ADAPTERS``
    adapters each."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    names: set[str] = set()
    for h in known:
        lora = lineage[h][2]
        new_name = lora is not None and lora not in names
        if len(chunk) == size or (new_name and len(names) == MAX_ADAPTERS):
            chunks.append(chunk)
            chunk, names = [], set()
        chunk.append(h)
        if lora is not None:
            names.add(lora)
    return [*chunks, chunk] if chunk else chunks


def lineage_fields(lineage: list[Lineage]) -> dict:
    """A message's ``KVEvents`` lineage fields for its stored blocks' lineage, in order: the
    parents, the tokens, and the adapters as indices into the message's adapter names (none
    when every block is the base model's)."""
    fields: dict = {
        "parents": [parent for parent, _, _ in lineage],
        "token_ids": list(chain.from_iterable(tokens for _, tokens, _ in lineage)),
    }
    names = list(dict.fromkeys(lora for _, _, lora in lineage if lora is not None))
    if names:
        index = {name: i for i, name in enumerate(names, start=1)}
        fields["lora_names"] = names
        fields["lora_index"] = [0 if lora is None else index[lora] for _, _, lora in lineage]
    return fields


class KVEventPublisher:
    """Publishes a worker's KV cache changes, one stream per KV tier (``tiers``: the device
    pool, then the offload tiers the worker has).

    ``drain(tier)`` / ``snapshot(tier)`` give a tier's net change (a ``KVDelta``, or a plain
    (stored, removed) pair) and contents; for the device tier they are called without an
    argument (so a plain pair of callables serves a worker without offload tiers)."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        instance: str,
        block_size: int,
        drain: Callable[..., KVDelta | tuple[list[int], list[int]]],
        snapshot: Callable[..., list[int]],
        interval: float,
        snapshot_seconds: float = KV_SNAPSHOT_SECONDS,
        tiers: tuple[str, ...] = ("device",),
        listeners: tuple[Listener, ...] = (),
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
        self.listeners = listeners
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
        got = self.drain(*args)
        delta = got if isinstance(got, KVDelta) else KVDelta(*got)
        out = []
        for stored, removed, lineage in self._split(delta):
            self.seq += 1
            cleared = delta.cleared and not out  # the first message clears, then the rest apply
            out.append(self._msg(stored, removed, tier, cleared=cleared, **lineage))
        return out

    def _split(self, delta: KVDelta) -> list[tuple[list[int], list[int], dict]]:
        """The delta as messages' (stored, removed, lineage fields), within the bounds."""
        n, lineage, bs = MAX_KV_EVENT_HASHES, delta.lineage, self.block_size
        known = [h for h in delta.stored if h in lineage]
        unknown = [h for h in delta.stored if h not in lineage] if lineage else delta.stored
        per_known = max(1, min(n // 2, MAX_KV_EVENT_TOKENS // bs))  # a parent each, bs tokens
        parts = []
        removed = delta.removed
        for chunk in _lineage_chunks(known, lineage, per_known):
            room = n - 2 * len(chunk)
            parts.append((chunk, removed[:room], lineage_fields([lineage[h] for h in chunk])))
            removed = removed[room:]
        for i in range(0, len(unknown), n):
            chunk = unknown[i : i + n]
            room = n - len(chunk)
            parts.append((chunk, removed[:room], {}))
            removed = removed[room:]
        for i in range(0, len(removed), n):
            parts.append(([], removed[i : i + n], {}))
        if not parts and delta.cleared:
            parts.append(([], [], {}))
        return parts

    def _msg(self, stored: list[int], removed: list[int], tier: str, **kw) -> KVEvents:
        return KVEvents(
            worker_id=self.worker_id,
            instance=self.instance,
            block_size=self.block_size,
            seq=self.seq,
            stored=stored,
            removed=removed,
            tier=tier,
            **kw,
        )

    async def publish_now(self, snapshot: bool = False) -> None:
        subject = self.bus.subjects.kv(self.worker_id)
        msgs = self.messages(snapshot)
        for listener in self.listeners:
            try:
                listener(msgs)
            except Exception:  # another stream's fault must not stop this one
                log.exception("KV event listener failed")
        for msg in msgs:
            try:
                await self.bus.publish(subject, msg)
            except Exception as exc:  # disconnected: the snapshot after the reconnect repairs it
                log.debug("KV events not published: %s", exc)
                return
