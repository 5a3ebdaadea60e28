"""What crosses into the engine thread: commands, applied in order at the start of a step, and
the one stream that comes out besides step results, the prefix cache's events.

Other threads never touch engine state. They post a command (``LLMEngine.add_request``,
``abort``, ``release``, ``kv_ready``, ``kv_failed``, ``hold_block``), and the thread that steps
the engine applies it before it schedules. A command that needs an answer carries a
``concurrent.futures.Future`` (``asyncio.wrap_future`` awaits it from an event loop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.shared.sampling import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    bus_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: tuple[int, ...] = ()  # tokens generated elsewhere (the first token)
    remote_kv: bool = False  # the prompt's KV is pulled from a prefill worker, not computed


@dataclass(frozen=True)
class Abort:
    bus_id: str
    index: int | None = None  # one choice (sampling.n > 1), or None: the whole request


@dataclass(frozen=True)
class Release:
    bus_id: str  # a parked (PREFILLED) request or a held block


@dataclass(frozen=True)
class KVReady:
    bus_id: str


@dataclass(frozen=True)
class KVFailed:
    bus_id: str
    error: str


@dataclass(frozen=True)
class HoldBlock:
    hold_id: str
    reply: Future  # -> the block id, or BlockHoldRefused


Command = AddRequest | Abort | Release | KVReady | KVFailed | HoldBlock


class BlockHoldRefused(Exception):
    """``hold_block`` could not spare a block without taking it from a request."""


class KVEventFeed:
    """The KV cache's changes per tier, from the engine (and disk) threads to one consumer.

    The engine thread ``push``es each step's net (stored, removed) hashes of its device pool;
    the offload tiers' events (host memory, disk: ``kv_tiers/tier_events.py``) are taken from
    ``take_tier_events`` when the consumer collects. The consumer's ``drain(tier)`` returns the
    net change of that tier since its previous ``drain``/``snapshot``, and ``snapshot(tier)``
    every hash the tier holds now. The consumer keeps its own copy of each tier's hashes, built
    from the events, so neither call has to stop the engine.
    """

    def __init__(
        self,
        tiers: tuple[str, ...] = ("device",),
        take_tier_events: Callable[[], list[tuple[str, bool, int]]] | None = None,
    ) -> None:
        self.tiers = tiers
        self._outbox: deque[tuple[list[int], list[int]]] = deque()
        self._take = take_tier_events
        self._cached: dict[str, dict[int, None]] = {t: {} for t in tiers}
        # per tier: net (stored, removed) since the consumer's last drain of it
        self._pending: dict[str, tuple[dict[int, None], dict[int, None]]] = {
            t: ({}, {}) for t in tiers
        }

    def push(self, stored: list[int], removed: list[int]) -> None:
        self._outbox.append((stored, removed))

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

    def _collect(self) -> None:
        while self._outbox:
            s, r = self._outbox.popleft()
            for h in s:
                self._apply("device", h, True)
            for h in r:
                self._apply("device", h, False)
        if self._take is not None:
            for tier, stored_now, h in self._take():
                if tier in self._pending:
                    self._apply(tier, h, stored_now)

    def drain(self, tier: str = "device") -> tuple[list[int], list[int]]:
        self._collect()
        stored, removed = self._pending[tier]
        self._pending[tier] = ({}, {})
        return list(stored), list(removed)

    def snapshot(self, tier: str = "device") -> list[int]:
        self._collect()
        self._pending[tier] = ({}, {})  # a snapshot replaces what the consumer knew
        return list(self._cached[tier])
