"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, and a prefix cache.

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block whose KV has been
computed is registered under a chained hash (parent block's hash + this block's tokens), so a later
sequence with the same prefix reuses it instead of recomputing it. Hashes are blake2b over a fixed
byte encoding, so they agree across processes and restarts (the gateway's KV-aware router and other
workers compute the same values).

A forked sequence (another choice of the same request, ``fork``) takes its parent's full prompt
blocks by reference and a private copy of the block it writes into.

Freed blocks keep their hash and stay reusable until their space is needed: the free list is
ordered least-recently-freed first, so allocation evicts the coldest cached block.

With KV offload tiers (``kv_tiers/``, wired by ``offload.py``), an evicted cached block is handed
to ``on_evict`` before its slot is reused, and a prefix lookup goes on in the tiers where the
pool's blocks end: a block found there gets a new pool block, and the load into it waits in
``loads`` for the engine (from host memory before the step's forward pass; from disk while the
sequence waits, ``Scheduler.kv_loaded``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pdserve.services.engine.sequence import Sequence
from pdserve.shared.discovery.kv_delta import Lineage
from pdserve.shared.kv.layout import hash_block, prefix_block_hashes

if TYPE_CHECKING:  # the tiers hold tensors; the scheduler's tests need none
    from pdserve.services.engine.kv_tiers import Claim, KVTiers


@dataclass(frozen=True)
class CachedPrefix:
    """The longest cached prefix of a sequence's tokens, as looked up: nothing is attached to
    the sequence or counted until ``BlockManager.attach_prefix``."""

    hashes: list[int]  # of the full blocks looked up
    # the blocks caching the first ``len(block_ids)`` of them; None: found in a tier below the
    # pool, to be loaded into a new block
    block_ids: list[int | None]
    num_free_blocks: int  # of those, on the free list: attaching them takes them off it
    num_tokens: int  # the tokens whose KV they hold

    @property
    def num_pool_blocks(self) -> int:
        return sum(1 for b in self.block_ids if b is not None)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # the prefix cache: block hash -> id of the block holding that KV (in use or free)
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Each block's generation: the count of blocks taken off the free list when this one
        # last was (0: never). A block's KV is overwritten only after it is taken again, which
        # raises its generation above every earlier one: a lease records the highest of its
        # blocks' (its epoch), and the KV server refuses a pull whose blocks have risen past
        # it - freed and reused since - whatever the lease table says (lease.py). Written by
        # the engine thread, read by the KV server's: aligned 8-byte entries, never torn.
        self.generations = np.zeros(num_blocks, dtype=np.int64)
        self.taken = 0
        # per sequence (by seq_id): hashes of its blocks registered so far (prefix of block_table)
        self.seq_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # What entered and left the prefix cache since the last drain: workers publish these so
        # the gateway can route a prompt to the worker that already holds its prefix.
        self.stored_events: list[int] = []
        self.removed_events: list[int] = []
        # the stored blocks' lineage for the KV event stream, by hash: (parent hash, tokens,
        # adapter), kept from the hashing ``commit`` does anyway (``take_lineage`` hands them out)
        self.lineage: dict[int, Lineage] = {}
        # KV offload (``offload.py`` sets these): where evicted cached blocks go, the tiers a
        # prefix lookup continues in, and the loads attached prefixes wait for, by seq_id
        self.on_evict: Callable[[int, int], None] | None = None
        self.tiers: KVTiers | None = None
        self.loads: dict[str, list[tuple[int, Claim]]] = {}
        self.cleared = False  # reset since the last publish: AllBlocksCleared is due

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(
        self, seq: Sequence, num_tokens: int, prefix: CachedPrefix | None = None
    ) -> int:
        """New blocks ``seq`` needs to cover ``num_tokens`` tokens (beyond ``prefix``, when
        that is to be attached first)."""
        held = len(seq.block_table) + (prefix.num_pool_blocks if prefix is not None else 0)
        return max(0, -(-num_tokens // self.block_size) - held)

    def can_allocate(
        self, seq: Sequence, num_tokens: int, prefix: CachedPrefix | None = None, headroom: int = 0
    ) -> bool:
        """May ``seq`` cover ``num_tokens`` tokens (``prefix`` attached first: its free blocks
        leave the free list too) and leave ``headroom`` blocks free?"""
        reclaimed = prefix.num_free_blocks if prefix is not None else 0
        need = self.blocks_needed(seq, num_tokens, prefix) + reclaimed + headroom
        return need <= len(self.free)

    def room(self, seq: Sequence, num_tokens: int, reserved: int) -> int:
        """How many tokens past its first ``num_tokens`` ``seq`` could write into the blocks it
        holds and free ones, leaving ``reserved`` blocks free for others."""
        blocks = max(len(seq.block_table), -(-num_tokens // self.block_size))
        spare = len(self.free) - self.blocks_needed(seq, num_tokens) - reserved
        return (blocks + max(0, spare)) * self.block_size - num_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` so it covers ``num_tokens`` tokens."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        old = self.block_hash[block_id]
        if old is not None:  # evict: its cached content is about to be overwritten
            if self.hash_to_block.get(old) == block_id:
                del self.hash_to_block[old]
                self.removed_events.append(old)
                self._bound_events()
                if self.on_evict is not None:  # cached, no user: down a tier, still intact
                    self.on_evict(block_id, old)
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        self.taken += 1
        self.generations[block_id] = self.taken
        return block_id

    def find_prefix(self, seq: Sequence) -> CachedPrefix:
        """Look up the longest cached prefix of a fresh sequence, changing nothing (admission
        checks that the rest fits before it attaches anything).

        At least one token is always left to compute, because the engine needs the last
        position's logits to sample.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id} already has blocks")
        if not self.enable_prefix_cache:
            return CachedPrefix(hashes=[], block_ids=[], num_free_blocks=0, num_tokens=0)
        prompt = seq.token_ids[: seq.num_tokens - 1]
        hashes = prefix_block_hashes(
            prompt, self.block_size, seq.hash_root, extra_keys=seq.kv_identity
        )
        blocks: list[int | None] = []
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None and (self.tiers is None or self.tiers.where(h) is None):
                break
            blocks.append(block_id)
        free = sum(1 for b in blocks if b is not None and self.ref_counts[b] == 0)
        return CachedPrefix(
            hashes=hashes,
            block_ids=blocks,
            num_free_blocks=free,
            num_tokens=len(blocks) * self.block_size,
        )

    def attach_prefix(self, seq: Sequence, prefix: CachedPrefix) -> int:
        """Attach ``prefix``, just looked up for ``seq``, and count the lookup in the prefix
        cache's queries and hits. Returns the number of tokens whose KV is reused."""
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id} already has blocks")
        self.prefix_queries += len(prefix.hashes)
        block_ids, claims = self._claim_tiers(prefix)
        for block_id in block_ids:  # the pool's own first: no allocation below may evict them
            if block_id is not None:
                if self.ref_counts[block_id] == 0:
                    del self.free[block_id]
                self.ref_counts[block_id] += 1
        loads = []
        for i, block_id in enumerate(block_ids):
            if block_id is None:
                block_id = self._take_free_block()
                loads.append((block_id, claims[i]))
            seq.block_table.append(block_id)
        if loads:
            self.loads[seq.seq_id] = loads
        self.prefix_hits += len(block_ids)
        # blocks from the first load on register once their KV is in (``commit``)
        first_load = next((i for i, b in enumerate(block_ids) if b is None), len(block_ids))
        self.seq_hashes[seq.seq_id] = prefix.hashes[:first_load]
        return len(block_ids) * self.block_size

    def _claim_tiers(self, prefix: CachedPrefix) -> tuple[list[int | None], dict[int, Claim]]:
        """Claim the prefix's blocks found in the tiers, so nothing evicts them before their
        load; the prefix ends before one that is gone since the lookup (a disk file found
        corrupt meanwhile)."""
        claims: dict[int, Claim] = {}
        for i, (h, block_id) in enumerate(zip(prefix.hashes, prefix.block_ids, strict=False)):
            if block_id is None:
                claim = self.tiers.claim(h) if self.tiers is not None else None
                if claim is None:
                    return prefix.block_ids[:i], claims
                claims[i] = claim
        return prefix.block_ids, claims

    def waits_for_load(self, seq: Sequence) -> bool:
        """Part of ``seq``'s attached prefix loads off the engine thread (from disk)."""
        return any(claim.slow for _, claim in self.loads.get(seq.seq_id, ()))

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is now computed, so later prompts can reuse them."""
        if not self.enable_prefix_cache:
            return
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        parent = hashes[-1] if hashes else seq.hash_root  # its salt's chain
        bs = self.block_size
        for i in range(len(hashes), full):
            block_tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, block_tokens, seq.kv_identity if i == 0 else ())
            hashes.append(h)
            block_id = seq.block_table[i]
            # First writer wins; a duplicate block computed concurrently stays private.
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
                self.stored_events.append(h)
                self.lineage[h] = (parent, block_tokens, seq.lora_name)
                self._bound_events()
            parent = h

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give ``child`` (no blocks yet) the KV of ``parent``'s first ``num_tokens`` tokens.

        The full blocks before the one holding the last of those tokens are shared (one more
        reference each, their prefix-cache hashes inherited); that last block becomes a private
        copy, because the child writes into it: it recomputes that token and appends after it.
        Returns the copy the caller must make in the KV cache, (source block, new block), or None
        and changes nothing when no block is free.
        """
        if child.block_table:
            raise RuntimeError(f"{child.seq_id} already has blocks")
        if not self.free:
            return None
        last = (num_tokens - 1) // self.block_size
        shared = parent.block_table[:last]
        for block_id in shared:  # in use by the parent: never on the free list
            self.ref_counts[block_id] += 1
        copy = self._take_free_block()
        child.block_table = [*shared, copy]
        if self.enable_prefix_cache:
            self.seq_hashes[child.seq_id] = self.seq_hashes.get(parent.seq_id, [])[:last]
        return parent.block_table[last], copy

    def trim(self, seq: Sequence) -> None:
        """Free the tail blocks past ``seq.num_computed_tokens``: a speculative step's rejected
        drafts left only rolled-back KV in them. They were never registered (``commit`` takes
        only computed tokens) and go to the front of the free list: their content is worth
        nothing, so they are reused before any cached block is evicted."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks in the prefix cache stay reusable (free but
        evictable) until their space is needed."""
        # Tail blocks first, so the end of a chain is evicted before its prefix.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
        seq.block_table = []
        self.seq_hashes.pop(seq.seq_id, None)

    def _bound_events(self) -> None:
        """Keep undrained events bounded when nobody drains them (an engine without a worker
        around it): fold them into their net effect, and past that forget the oldest removals
        (a consumer then believes a few evicted blocks are still cached until its next
        snapshot - a routing miss, never a wrong answer)."""
        limit = 4 * self.num_blocks + 1024
        if len(self.stored_events) + len(self.removed_events) <= limit:
            return
        stored, removed = self._net_events()
        self.stored_events, self.removed_events = stored, removed[-(limit // 2) :]
        self.lineage = {h: self.lineage[h] for h in stored if h in self.lineage}

    def _net_events(self) -> tuple[list[int], list[int]]:
        stored = [h for h in dict.fromkeys(self.stored_events) if h in self.hash_to_block]
        removed = [h for h in dict.fromkeys(self.removed_events) if h not in self.hash_to_block]
        return stored, removed

    def reset_prefix_cache(self, external: bool = False) -> tuple[int, int] | None:
        """Forget every cached block (``POST /reset_prefix_cache``) and, ``external``, every
        block of the offload tiers: how many of each, or None and nothing changed while any
        block is in use (a sequence, a lease, a hold, a tier load). Pending events go too:
        ``cleared`` tells the engine to announce AllBlocksCleared, after which the stream
        starts from nothing (the tiers announce their removals themselves)."""
        if self.num_used_blocks or self.loads:
            return None
        forgotten = len(self.hash_to_block)
        in_tiers = self.tiers.clear() if external and self.tiers is not None else 0
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.seq_hashes.clear()
        self.stored_events, self.removed_events, self.lineage = [], [], {}
        self.cleared = True
        return forgotten, in_tiers

    def drain_events(self) -> tuple[list[int], list[int]]:
        """The net change of the prefix cache since the last call: (stored, removed) hashes.

        A hash stored and evicted (or evicted and stored again) within one interval appears
        once, on the side that is true now, so a receiver can apply the two lists in any order.
        """
        stored, removed = self._net_events()
        self.stored_events, self.removed_events = [], []
        return stored, removed

    def take_lineage(self, stored: list[int]) -> dict[int, Lineage]:
        """The (parent hash, tokens, adapter) of ``stored`` (what ``drain_events`` just returned),
        and forget the rest: a block stored and evicted in between needs none."""
        lineage, self.lineage = self.lineage, {}
        return {h: lineage[h] for h in stored if h in lineage}
