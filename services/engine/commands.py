"""What crosses into the engine thread: commands, applied in order at the start of a step, and
the one stream that comes out besides step results, the prefix cache's events.

Other threads never touch engine state. They post a command (``LLMEngine.add_request``,
``abort``, ``release``, ``kv_ready``, ``kv_failed``, ``hold_block``), and the thread that steps
the engine applies it before it schedules. A command that needs an answer carries a
``concurrent.futures.Future`` (``asyncio.wrap_future`` awaits it from an event loop).
"""

from __future__ import annotations

from collections import deque
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
    """The prefix cache's changes, from the engine thread to one consumer thread.

    The engine thread ``push``es each step's net (stored, removed) hashes; the consumer's
    ``drain`` returns the net change since its previous ``drain``/``snapshot``, and ``snapshot``
    every hash cached now. The consumer keeps its own copy of the cache's hashes, built from the
    events, so neither call has to stop the engine.
    """

    def __init__(self) -> None:
        self._outbox: deque[tuple[list[int], list[int]]] = deque()
        self._cached: dict[int, None] = {}

    def push(self, stored: list[int], removed: list[int]) -> None:
        self._outbox.append((stored, removed))

    def _collect(self) -> tuple[dict[int, None], dict[int, None]]:
        stored: dict[int, None] = {}
        removed: dict[int, None] = {}
        while self._outbox:
            s, r = self._outbox.popleft()
            for h in s:
                removed.pop(h, None)
                stored[h] = None
                self._cached[h] = None
            for h in r:
                stored.pop(h, None)
                removed[h] = None
                self._cached.pop(h, None)
        return stored, removed

    def drain(self) -> tuple[list[int], list[int]]:
        stored, removed = self._collect()
        return list(stored), list(removed)

    def snapshot(self) -> list[int]:
        self._collect()
        return list(self._cached)
