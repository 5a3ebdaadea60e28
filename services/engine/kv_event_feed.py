"""The KV cache's changes per tier, from the engine (and disk) threads to one consumer.

The engine thread ``push``es each step's net (stored, removed) hashes of its device pool, with
the stored blocks' lineage (parent hash, tokens and LoRA adapter: what ``BlockManager.commit``
hashed anyway);
the offload tiers' events (host memory, disk: ``kv_tiers/tier_events.py``) are taken from
``take_tier_events`` when the consumer collects. Any thread may ``clear`` a tier (every block
gone: AllBlocksCleared). The consumer's ``drain(tier)`` / ``drain_delta(tier)`` return the net
change of that tier since its previous ``drain``/``snapshot``, and ``snapshot(tier)`` every
hash the tier holds now. The consumer keeps its own copy of each tier's hashes, built from the
events, so neither call has to stop the engine.

Lineage is kept here, on the consumer's thread, for blocks some tier holds, so a block evicted
from the pool reaches host memory and disk with its parent and tokens (the engine thread does
nothing more per block than record what it hashed). It is bounded (``LINEAGE_LIMIT``, oldest
first out): past that a block goes out without its lineage, which costs an external router
that block, never a wrong answer. Disk blocks indexed at start have none (files name the hash
only).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable

from pdserve.shared.discovery.kv_delta import KVDelta, Lineage

DEVICE = "device"
LINEAGE_LIMIT = 1 << 18  # blocks whose lineage is remembered (~100 B each with 16 tokens)

# what the engine thread posts: a step's (stored, removed, lineage of stored), or a tier's clear
_Posted = tuple[list[int], list[int], dict[int, Lineage]] | str


class KVEventFeed:
    def __init__(
        self,
        tiers: tuple[str, ...] = (DEVICE,),
        take_tier_events: Callable[[], list[tuple[str, bool, int]]] | None = None,
    ) -> None:
        self.tiers = tiers
        self._outbox: deque[_Posted] = deque()  # appends and poplefts are atomic
        self._take = take_tier_events
        self._cached: dict[str, dict[int, None]] = {t: {} for t in tiers}
        # per tier: net (stored, removed) since the consumer's last drain of it, and its clears
        self._pending: dict[str, tuple[dict[int, None], dict[int, None]]] = {
            t: ({}, {}) for t in tiers
        }
        self._cleared: set[str] = set()
        self._lineage: dict[int, tuple[int, array, str | None]] = {}
        self._dropped: list[int] = []  # removed in this collection: their lineage may go

    # ---- producers (the engine thread; ``clear``: any thread) ---------------------------------

    def push(
        self,
        stored: list[int],
        removed: list[int],
        lineage: dict[int, Lineage] | None = None,
    ) -> None:
        self._outbox.append((stored, removed, lineage or {}))

    def clear(self, tier: str = DEVICE) -> None:
        """Every block of ``tier`` is gone (a reset prefix cache, an emptied tier)."""
        self._outbox.append(tier)

    # ---- the consumer's thread ----------------------------------------------------------------

    def _apply(self, tier: str, h: int, stored_now: bool) -> None:
        stored, removed = self._pending[tier]
        if stored_now:
            removed.pop(h, None)
            stored[h] = None
            self._cached[tier][h] = None
        else:
            stored.pop(h, None)
            removed[h] = None
            self._cached[tier].pop(h, None)
            self._dropped.append(h)

    def _forget_dropped(self) -> None:
        """Drop the lineage of blocks no tier holds any more. Only once a collection is
        applied: a block the pool evicts leaves it before host memory's event says it arrived."""
        for h in self._dropped:
            if h in self._lineage and not any(h in held for held in self._cached.values()):
                del self._lineage[h]
        self._dropped = []

    def _apply_clear(self, tier: str) -> None:
        held = self._cached[tier]
        self._cached[tier] = {}
        self._pending[tier] = ({}, {})
        self._cleared.add(tier)
        self._dropped += held

    def _remember(self, lineage: dict[int, Lineage]) -> None:
        for h, (parent, tokens, lora) in lineage.items():
            # 4 bytes a token, not a list's 36; the adapter's name is shared, not copied
            self._lineage[h] = (parent, array("i", tokens), lora)
        while len(self._lineage) > LINEAGE_LIMIT:
            del self._lineage[next(iter(self._lineage))]

    def _collect(self) -> None:
        while self._outbox:
            posted = self._outbox.popleft()
            if isinstance(posted, str):
                if posted in self._pending:
                    self._apply_clear(posted)
                continue
            s, r, lineage = posted
            self._remember(lineage)
            for h in s:
                self._apply(DEVICE, h, True)
            for h in r:
                self._apply(DEVICE, h, False)
        if self._take is not None:
            for tier, stored_now, h in self._take():
                if tier in self._pending:
                    self._apply(tier, h, stored_now)
        self._forget_dropped()

    def drain(self, tier: str = DEVICE) -> tuple[list[int], list[int]]:
        """The tier's net (stored, removed) since the last drain (``drain_delta``: with clears
        and lineage)."""
        delta = self.drain_delta(tier)
        return delta.stored, delta.removed

    def drain_delta(self, tier: str = DEVICE) -> KVDelta:
        self._collect()
        stored, removed = self._pending[tier]
        self._pending[tier] = ({}, {})
        cleared = tier in self._cleared
        self._cleared.discard(tier)
        known: dict[int, Lineage] = {h: self._lineage[h] for h in stored if h in self._lineage}
        return KVDelta(stored=list(stored), removed=list(removed), cleared=cleared, lineage=known)

    def snapshot(self, tier: str = DEVICE) -> list[int]:
        self._collect()
        self._pending[tier] = ({}, {})  # a snapshot replaces what the consumer knew
        self._cleared.discard(tier)
        return list(self._cached[tier])
