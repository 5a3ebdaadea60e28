"""What crosses into the engine thread: commands, applied in order at the start of a step, and
the one stream that comes out besides step results, the prefix cache's events
(``kv_event_feed.py``).

Other threads never touch engine state. They post a command (``LLMEngine.add_request``,
``abort``, ``release``, ``kv_ready``, ``kv_failed``, ``hold_block``), and the thread that steps
the engine applies it before it schedules. A command that needs an answer carries a
``concurrent.futures.Future`` (``asyncio.wrap_future`` awaits it from an event loop).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.services.engine.kv_event_feed import KVEventFeed  # noqa: F401 (moved there)
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
    first_token: int | None = None  # a streamed pull's: the prefill worker's sampled token


@dataclass(frozen=True)
class KVFailed:
    bus_id: str
    error: str


@dataclass(frozen=True)
class HoldBlock:
    hold_id: str
    reply: Future  # -> the block id, or BlockHoldRefused


@dataclass(frozen=True)
class ResetPrefixCache:
    # -> (the pool's cached blocks forgotten, the tiers'), or None: a block in use kept them all
    reply: Future
    external: bool = False  # the offload tiers' blocks too (vLLM's ``reset_external``)


Command = AddRequest | Abort | Release | KVReady | KVFailed | HoldBlock | ResetPrefixCache


class BlockHoldRefused(Exception):
    """``hold_block`` could not spare a block without taking it from a request."""
