"""Choosing workers for a request from the live registry's load reports and cache contents.

Prefill goes to the worker with the lowest estimated cost, in blocks of prefill work::

    cost = PREFIX_WEIGHT * (prompt blocks it would still have to compute) + (work queued there)

The first term comes from the workers' own prefix caches: they publish the chained hashes of the
blocks they store and evict (``KVEvents``), the registry keeps one set per worker, and the router
hashes the prompt the same way (``prefix_block_hashes``, with that worker's block size) and counts
the leading blocks the worker holds. Because those events lag by up to a heartbeat, the router
also counts the blocks of prompts *it* sent a worker in the last few seconds as held there: the
second turn of a chat, sent right after the first, still finds the first turn's worker.

With KV offload tiers the workers publish one stream per tier (``KVEvents.tier``), and a prompt
block the pool has lost may still be in host memory or on disk, loaded back instead of computed.
Each leading block then costs what its fastest tier costs to load, as a fraction of computing
it (device 0; host and disk measured by the worker and sent in its heartbeat, else
``DEFAULT_LOAD_COST``)::

    cost = PREFIX_WEIGHT * (blocks to compute + sum of the held blocks' load costs) + queued

so a device hit beats a host hit beats a disk hit beats a miss, by as much as each tier costs.

The second term keeps one hot prefix (a system prompt every worker holds) from herding every
request onto one worker: equal prefix terms leave the load to decide. Work queued is the reported
queue times the typical prompt's blocks, plus the blocks this router sent since that report. Exact
ties go to the prompt's rendezvous "home" (a hash of its first block and the worker id), so
gateways agree where a new prefix should land, and only a joining or leaving worker's share moves.

Decode goes to the worker with the fewest requests among those with room for the request's
blocks, then the most free KV blocks.

Load reports arrive every ~0.5 s, which is long enough for a burst of requests to all pick the
same "least loaded" worker (8 streams once split 7:1). So the router also counts what *this*
gateway has in flight on each decode worker, from the pick until the request ends, and takes
the larger of that and the worker's reported running + waiting: the count is exact and current
for this gateway's own requests, the report covers other gateways' with a heartbeat's lag. It
likewise remembers the blocks it sent each worker since that worker's last report and takes
them off the reported free blocks (the next report already includes them).

A request under a LoRA adapter goes only to workers configured with it, and its prompt hashes
with the adapter in the first block (as the workers' caches do). A worker where the adapter is
not resident would load it first (``lora_resident`` in its report): that adds
``ADAPTER_LOAD_BLOCKS`` to its prefill cost and ``ADAPTER_LOAD_REQUESTS`` to its decode count.

The router keeps load, not requests: per bus id only the worker where that id's load is counted
(``_in_prefill``, ``_in_decode``), so that ``prefill_done`` and ``decode_done`` take it off
there. Which requests are in flight is the dispatcher's table (``gateway/inflight/dispatcher.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.kv.layout import ROOT_HASH, identity_keys, prefix_block_hashes

MAX_REMEMBER_SECONDS = 2.0  # a few heartbeat intervals
# Cost of one prompt block a worker must compute, relative to one block of work queued there.
# Above 1 because the load side is coarse and lags: a report taken while a request ran still
# counts it for up to a heartbeat after it finished, and each queued request counts as a typical
# prompt. A cache holder should lose a request only to a clearly emptier worker; equal prefix
# terms (a system prompt every worker holds) still leave the choice to the load alone.
PREFIX_WEIGHT = 2.0
# How long a prompt's blocks count as held by the worker it was sent to before that worker's own
# events say so (they lag by a heartbeat, a long queue by more).
EXPECT_SECONDS = 10.0
MAX_EXPECTED_BLOCKS = 1 << 16  # per worker; the oldest expectations go first
TYPICAL_DECAY = 0.1  # moving average of the prefill blocks per routed prompt
# what loading an adapter (reading it, copying it into a slot) weighs against other work
ADAPTER_LOAD_BLOCKS = 4
ADAPTER_LOAD_REQUESTS = 2
# Loading one block from a tier, as a fraction of computing it, until the worker measures it.
# Host: a PCIe copy of a block (~0.5 MB for a 1B model at 25 GB/s: ~20 us) against its forward
# pass (16 tokens of a 1B model: ~0.1 ms on an H100), with the scheduling around it. Disk: an
# NVMe read at a few GB/s, off the engine thread, but the sequence waits for it.
DEFAULT_LOAD_COST = {"device": 0.0, "host": 0.1, "disk": 0.5}


def serving_adapter(workers: list[WorkerLoad], lora: str | None) -> list[WorkerLoad]:
    """The workers configured with adapter ``lora`` (all of them for the base model)."""
    return workers if lora is None else [w for w in workers if lora in w.lora_adapters]


def _rendezvous(key: bytes, worker_id: str) -> int:
    digest = hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class _Sent:
    at: float  # wall-clock time (comparable with WorkerLoad.ts)
    blocks: int


@dataclass
class _Cost:
    worker: WorkerLoad
    cost: float
    hashes: list[int]  # the prompt's block hashes at this worker's block size
    new_blocks: int  # prompt blocks it would compute


@dataclass
class Router:
    """Picks a prefill worker (cheapest: cached prefix vs queued work) and a decode worker (most
    free KV blocks)."""

    # role -> live workers that take new requests: the worker registry's ``routable``
    routable: Callable[[str], Iterable[WorkerLoad]]
    block_size: int
    model: str | None = None  # only workers serving this model qualify
    # (worker id, prompt block hashes) -> leading blocks its prefix cache holds (its KV events)
    cached_hits: Callable[[str, list[int]], int] = lambda worker_id, hashes: 0
    # (worker id, prompt block hashes) -> per leading block, the fastest KV tier holding it
    # (the registry's ``tier_chain``); None: only ``cached_hits``, all on the device
    cached_tiers: Callable[[str, list[int]], list[str]] | None = None
    prefix_weight: float = PREFIX_WEIGHT
    # "kv": the cost above; "round-robin": cache-blind rotation, the baseline it is measured against
    prefill_policy: str = "kv"
    _turn: int = 0
    _sent: dict[str, list[_Sent]] = field(default_factory=dict)
    # worker id -> block hash -> when this router sent it a prompt with that block
    _expected: dict[str, OrderedDict[int, float]] = field(default_factory=dict)
    _typical_blocks: float = 0.0
    _in_prefill: dict[str, tuple[str, _Sent]] = field(default_factory=dict)  # request -> sent
    _in_decode: dict[str, str] = field(default_factory=dict)  # request -> decode worker
    _decoding: Counter[str] = field(default_factory=Counter)  # decode worker -> our requests

    def serving(self, role: str) -> list[WorkerLoad]:
        """The routable workers of ``role`` that serve this router's model."""
        return [w for w in self.routable(role) if self.model is None or w.model == self.model]

    def _recent(self, worker: WorkerLoad) -> list[_Sent]:
        # Keep only what the worker's last report cannot have counted yet; the age cap bounds
        # the damage of clock skew between this host and the worker's.
        oldest = time.time() - MAX_REMEMBER_SECONDS
        kept = [s for s in self._sent.get(worker.worker_id, []) if s.at >= max(worker.ts, oldest)]
        self._sent[worker.worker_id] = kept
        return kept

    def _remember(self, worker_id: str, blocks: int) -> None:
        self._sent.setdefault(worker_id, []).append(_Sent(time.time(), blocks))

    def blocks_for(self, num_tokens: int, block_size: int | None = None) -> int:
        size = block_size or (self.block_size if self.block_size > 0 else 16)
        return -(-num_tokens // size)

    def has_decode(self) -> bool:
        return bool(self.serving("decode"))

    def has_prefill(self) -> bool:
        return bool(self.serving("prefill"))

    # -- prefill: KV-aware ---------------------------------------------------------------------

    def cached_blocks(self, worker: WorkerLoad, hashes: list[int]) -> int:
        """Leading prompt blocks the worker holds in any tier (``cached_chain``)."""
        return len(self.cached_chain(worker, hashes))

    def cached_chain(self, worker: WorkerLoad, hashes: list[int]) -> list[str]:
        """Per leading prompt block the worker holds, the tier it is in: what its events say,
        with what this router sent it moments ago (not in its events yet) on the device."""
        if self.cached_tiers is not None:
            reported = self.cached_tiers(worker.worker_id, hashes)
        else:
            reported = ["device"] * self.cached_hits(worker.worker_id, hashes)
        sent = self._sent_blocks(worker, hashes)
        return ["device"] * sent + reported[sent:]

    def load_cost(self, worker: WorkerLoad, tier: str) -> float:
        """Loading one block from ``tier`` on ``worker``, as a fraction of computing it."""
        measured = {"host": worker.kv_host_load_cost, "disk": worker.kv_disk_load_cost}
        return measured.get(tier) or DEFAULT_LOAD_COST.get(tier, 1.0)

    def _sent_blocks(self, worker: WorkerLoad, hashes: list[int]) -> int:
        """Leading prompt blocks this router sent the worker in the last EXPECT_SECONDS."""
        expected = self._expected.get(worker.worker_id)
        if not expected:
            return 0
        now = time.monotonic()
        while expected and next(iter(expected.values())) < now - EXPECT_SECONDS:
            expected.popitem(last=False)
        sent = 0
        for h in hashes:
            if h not in expected:
                break
            sent += 1
        return sent

    def _expect(self, worker_id: str, hashes: list[int]) -> None:
        expected = self._expected.setdefault(worker_id, OrderedDict())
        now = time.monotonic()
        for h in hashes:
            expected[h] = now
            expected.move_to_end(h)
        while len(expected) > MAX_EXPECTED_BLOCKS:
            expected.popitem(last=False)

    def prefill_costs(self, prompt: list[int], root: int = ROOT_HASH) -> dict[str, float]:
        """Every live prefill worker's cost for this prompt (for inspection and tests)."""
        costs = self._costs(prompt, self.serving("prefill"), root)
        return {c.worker.worker_id: c.cost for c in costs}

    def _costs(
        self,
        prompt: list[int],
        candidates: list[WorkerLoad],
        root: int = ROOT_HASH,
        lora: str | None = None,
    ) -> list[_Cost]:
        typical = self._typical_blocks or self.blocks_for(len(prompt))
        by_size: dict[int, list[int]] = {}
        out = []
        keys = identity_keys(lora)  # the adapter is in the first block's hash, as workers hash
        for w in candidates:
            size = w.block_size or self.block_size or 16
            if size not in by_size:
                by_size[size] = prefix_block_hashes(prompt, size, root, extra_keys=keys)
            hashes = by_size[size]
            # The worker computes at least the last prompt token (it needs its logits), so it
            # reuses at most the full blocks before that token.
            chain = self.cached_chain(w, hashes)[: (len(prompt) - 1) // size]
            new_blocks = self.blocks_for(len(prompt), size) - len(chain)
            loads = sum(self.load_cost(w, tier) for tier in chain)
            queued = (w.waiting + w.running) * typical + sum(s.blocks for s in self._recent(w))
            cost = self.prefix_weight * (new_blocks + loads) + queued
            if lora is not None and lora not in w.lora_resident:
                cost += self.prefix_weight * ADAPTER_LOAD_BLOCKS
            out.append(_Cost(worker=w, cost=cost, hashes=hashes, new_blocks=new_blocks))
        return out

    def pick_prefill(
        self,
        prompt: list[int],
        exclude: set[str] | None = None,
        bus_id: str | None = None,
        root: int = ROOT_HASH,
        lora: str | None = None,
    ) -> str | None:
        """The prefill worker with the lowest cost for this prompt (see the module docstring);
        ``root``: its cache salt's chain (``chain_root``), whose blocks only count.

        With ``bus_id``, call ``prefill_done(bus_id)`` when its prefill answer arrives:
        its work then stops counting as queued at once, not only at the worker's next report.
        """
        live = self.serving("prefill")
        for gone in self._expected.keys() - {w.worker_id for w in live}:
            del self._expected[gone]  # left (or restarted under a new id): its cache is gone
        candidates = serving_adapter(
            [w for w in live if w.worker_id not in (exclude or set())], lora
        )
        if not candidates:
            return None
        pullable = {w.kv_layout for w in self.serving("decode")}
        if "" not in pullable:  # every decode worker says which blocks it can pull
            fitting = [w for w in candidates if w.kv_layout in pullable or not w.kv_layout]
            candidates = fitting or candidates  # none: the pull's refusal will say why
        costs = self._costs(prompt, candidates, root, lora)
        if self.prefill_policy == "round-robin":
            costs.sort(key=lambda c: c.worker.worker_id)
            best = costs[self._turn % len(costs)]
            self._turn += 1
        else:
            key = array("q", prompt[: self.block_size or 16]).tobytes()
            best = min(costs, key=lambda c: (c.cost, -_rendezvous(key, c.worker.worker_id)))
        worker_id = best.worker.worker_id
        t = self._typical_blocks
        self._typical_blocks = (
            best.new_blocks if not t else t + TYPICAL_DECAY * (best.new_blocks - t)
        )
        self._remember(worker_id, best.new_blocks)
        if bus_id is not None:
            self._in_prefill[bus_id] = (worker_id, self._sent[worker_id][-1])
        self._expect(worker_id, best.hashes)
        return worker_id

    def prefill_done(self, bus_id: str) -> None:
        worker_id, sent = self._in_prefill.pop(bus_id, (None, None))
        if worker_id is not None:
            with contextlib.suppress(ValueError):
                self._sent.get(worker_id, []).remove(sent)

    def pick_decode(
        self,
        total_tokens: int,
        exclude: set[str] | None = None,
        bus_id: str | None = None,
        kv_layout: str = "",
        lora: str | None = None,
    ) -> str | None:
        """The decode worker with the fewest requests (see the module docstring), then the most
        free blocks. With ``bus_id``, the request counts there until ``decode_done``.
        ``kv_layout``: the prefilled blocks' layout (shared.kv_layout): only workers that can
        pull them qualify, unless none can (its pull refusal then reaches the client)."""
        candidates = [w for w in self.serving("decode") if w.worker_id not in (exclude or set())]
        candidates = serving_adapter(candidates, lora)
        if not candidates:
            return None
        if kv_layout:
            fitting = [w for w in candidates if w.kv_layout in (kv_layout, "")]
            candidates = fitting or candidates
        if bus_id is not None:
            self.decode_done(bus_id)  # a retry moves it

        blocks = self.blocks_for(total_tokens)

        def busy(w: WorkerLoad) -> tuple[bool, int, int]:
            free = w.free_blocks - sum(s.blocks for s in self._recent(w))
            requests = max(w.running + w.waiting, self._decoding[w.worker_id])
            if lora is not None and lora not in w.lora_resident:
                requests += ADAPTER_LOAD_REQUESTS  # it would load the adapter first
            return (free < blocks, requests, -free)  # a worker with room first

        best = min(candidates, key=busy).worker_id
        self._remember(best, blocks)
        if bus_id is not None:
            self._in_decode[bus_id] = best
            self._decoding[best] += 1
        return best

    def decode_done(self, bus_id: str) -> None:
        worker_id = self._in_decode.pop(bus_id, None)
        if worker_id is not None:
            self._decoding[worker_id] -= 1
            if not self._decoding[worker_id]:
                del self._decoding[worker_id]

    def not_streaming(self, kv_layout: str) -> set[str]:
        """The decode workers that cannot pull KV of ``kv_layout`` layer by layer while it is
        prefilled (they say ``kv_stream``; a streamed pull moves whole blocks of one layout;
        a worker that names no layout is taken to fit, as ``pick_decode`` does)."""
        return {
            w.worker_id
            for w in self.serving("decode")
            if not w.kv_stream or w.kv_layout not in (kv_layout, "")
        }

    def can_stream(self, kv_layout: str = "") -> bool:
        """Whether any decode worker pulls streamed KV (of ``kv_layout``, if given)."""
        return any(
            w.kv_stream and (not kv_layout or w.kv_layout in (kv_layout, ""))
            for w in self.serving("decode")
        )

    def local_prefill_threshold(self) -> int:
        """Prompts shorter than this go straight to a decode worker (the workers advertise it)."""
        thresholds = [w.local_prefill_threshold for w in self.serving("decode")]
        return max(thresholds, default=0)
