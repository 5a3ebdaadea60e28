"""Choosing workers for a request from the live registry's load reports.

Prefill goes to the worker likely to hold the prompt's prefix in its cache (by a hash of the first
block), unless that worker is clearly busier than the least loaded one. Decode goes to the worker
with the most free KV blocks.

Load reports arrive every ~0.5 s, which is long enough for a burst of requests to all pick the
same "least loaded" worker. So the router also remembers what *this* gateway sent each worker
since that worker's last report and adds it to the reported load (the next report already
includes it, so the remembered part is dropped then).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.protocol import WorkerLoad

MAX_REMEMBER_SECONDS = 2.0  # a few heartbeat intervals
# A prompt goes to its prefix-cache "home" prefill worker unless that one has more than this
# many requests queued beyond the least loaded worker: a cache hit is not worth a long wait.
AFFINITY_SLACK = 2


def _rendezvous(key: bytes, worker_id: str) -> int:
    digest = hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class _Sent:
    at: float  # wall-clock time (comparable with WorkerLoad.ts)
    blocks: int


@dataclass
class Router:
    """Picks a prefill worker (least queued work) and a decode worker (most free KV blocks)."""

    loads: Callable[[str], Iterable[WorkerLoad]]  # role -> live, non-expired worker loads
    block_size: int
    model: str | None = None  # only workers serving this model qualify
    _sent: dict[str, list[_Sent]] = field(default_factory=dict)

    def live(self, role: str) -> list[WorkerLoad]:
        return [
            w
            for w in self.loads(role)
            if not w.draining and (self.model is None or w.model == self.model)
        ]

    def _recent(self, worker: WorkerLoad) -> list[_Sent]:
        # Keep only what the worker's last report cannot have counted yet; the age cap bounds
        # the damage of clock skew between this host and the worker's.
        oldest = time.time() - MAX_REMEMBER_SECONDS
        kept = [s for s in self._sent.get(worker.worker_id, []) if s.at >= max(worker.ts, oldest)]
        self._sent[worker.worker_id] = kept
        return kept

    def _remember(self, worker_id: str, blocks: int) -> None:
        self._sent.setdefault(worker_id, []).append(_Sent(time.time(), blocks))

    def blocks_for(self, num_tokens: int) -> int:
        size = self.block_size if self.block_size > 0 else 16
        return -(-num_tokens // size)

    def has_decode(self) -> bool:
        return bool(self.live("decode"))

    def has_prefill(self) -> bool:
        return bool(self.live("prefill"))

    def pick_prefill(self, prompt: list[int], exclude: set[str] | None = None) -> str | None:
        """The worker that most likely has this prompt's prefix cached, unless it is clearly
        busier than the least loaded one; otherwise the least loaded.

        Affinity is a rendezvous hash of the prompt's first KV block, so the turns of one chat
        (and prompts sharing a system prompt) keep landing where their prefix blocks already are,
        and only the prompts of a worker that joins or leaves move.
        """
        candidates = [w for w in self.live("prefill") if w.worker_id not in (exclude or set())]
        if not candidates:
            return None

        def queued(w: WorkerLoad) -> int:
            return w.waiting + w.running + len(self._recent(w))

        least = min(candidates, key=lambda w: (queued(w), -w.free_blocks))
        best = least
        size = self.block_size if self.block_size > 0 else 16
        if len(prompt) >= size:
            key = array("q", prompt[:size]).tobytes()
            home = max(candidates, key=lambda w: _rendezvous(key, w.worker_id))
            if queued(home) <= queued(least) + AFFINITY_SLACK:
                best = home
        self._remember(best.worker_id, self.blocks_for(len(prompt)))
        return best.worker_id

    def pick_decode(self, total_tokens: int, exclude: set[str] | None = None) -> str | None:
        candidates = [w for w in self.live("decode") if w.worker_id not in (exclude or set())]
        if not candidates:
            return None

        def room(w: WorkerLoad) -> tuple[int, int]:
            recent = self._recent(w)
            free = w.free_blocks - sum(s.blocks for s in recent)
            return (free, -(w.running + w.waiting + len(recent)))

        best = max(candidates, key=room)
        self._remember(best.worker_id, self.blocks_for(total_tokens))
        return best.worker_id

    def local_prefill_threshold(self) -> int:
        """Prompts shorter than this go straight to a decode worker (the workers advertise it)."""
        thresholds = [w.local_prefill_threshold for w in self.live("decode")]
        return max(thresholds, default=0)
