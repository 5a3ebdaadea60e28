"""One KV tier's net change between two collections by the worker's KV event publisher.

The engine side (``services/engine/kv_event_feed.py``) produces it; the publisher
(``kv_publisher.py``) turns it into ``KVEvents`` messages on NATS and, through its listeners,
into vLLM's KV-event format on ZMQ (``vllm_kv_events.py``). It lives here, below both, so the
bus side never imports the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# a stored block's (parent hash, its tokens, the LoRA adapter whose KV it holds, None for the
# base model); the parent of a prompt's first block is ROOT_HASH
Lineage = tuple[int, Sequence[int], str | None]


@dataclass
class KVDelta:
    stored: list[int]  # in the tier now
    removed: list[int]  # gone from it (disjoint from ``stored``)
    cleared: bool = False  # every block of the tier went first (AllBlocksCleared)
    # per stored hash whose lineage the worker knows; the others go out without
    lineage: dict[int, Lineage] = field(default_factory=dict)
