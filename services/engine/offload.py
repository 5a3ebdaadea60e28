"""KV offload tiers, engine side: what the pool evicts goes down a tier, what a prefix lookup
finds there comes back (``kv_tiers/`` holds the tiers; ``--kv-offload-ram-gib``,
``--kv-offload-disk``, ``--kv-offload-disk-gib``).

Everything here runs on the engine thread, around the scheduler's pass (``schedule``):

* **Eviction.** ``BlockManager`` calls ``_evicted`` when it reuses a free block that caches a
  prefix - never a block a sequence holds - and the block's bytes are copied to host memory
  right then, before anything can write into it (a forward pass, a fork's copy, a tier load or a
  pull all come later in the step). After the pass, ``KVTiers.settle`` waits for those copies
  on CUDA, so a KV pull over UCX into a reused block cannot overtake them, and posts the disk
  writes.
* **Lookup and load.** A prefix lookup goes on in the tiers where the pool's blocks end. Blocks
  found in host memory are copied into their new pool blocks right after the pass, ahead of the
  step's forward pass on the same stream, and count as prefix hits like pool blocks. Blocks on
  disk are read on the disk tier's thread while their sequence waits as a pull does (blocks
  reserved, ``WAITING_FOR_REMOTE_KV``); when the read is done the next step copies them in and
  the scheduler's ``kv_loaded`` makes the sequence runnable, so other sequences keep stepping
  meanwhile. A block that fails its checksum is never copied: the sequence is computed instead.

At tensor parallelism the other ranks hold their shards of the tiers' blocks and copy what rank
0 copies, told once per pass (``parallel/tier_mirror.py``); the tiers' budgets are the worker's.

Preemption, forks and speculative rollback need nothing more: they only free blocks, and a
freed block reaches a tier only once it is evicted, holding the KV its hash names. The bytes
copied are the pool's own (an int8/fp8 cache's scales included), so any ``--kv-cache-dtype``
works; the layout fingerprint and the weights digest keep another layout's or checkpoint's
files out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pdserve.services.engine.kv_event_feed import KVEventFeed
from pdserve.services.engine.kv_tiers import KVTiers, TierStats
from pdserve.services.engine.kv_tiers.load_cost import CopyTimer, LoadCosts
from pdserve.services.engine.kv_tiers.weights_digest import weights_digest
from pdserve.services.engine.parallel.tier_mirror import TierLog
from pdserve.shared.errors import StartupError
from pdserve.shared.kv.layout import layout_id

if TYPE_CHECKING:
    from pdserve.services.engine.block_manager import BlockManager
    from pdserve.services.engine.outputs import ScheduledBatch, StepStats
    from pdserve.services.engine.parallel.group import RankGroup
    from pdserve.services.engine.parallel.shard import Shard
    from pdserve.services.engine.scheduler import Scheduler
    from pdserve.shared.config import EngineConfig

log = logging.getLogger(__name__)
GIB = 1 << 30


class Engine(Protocol):
    """What the offload takes from ``LLMEngine`` (which builds it)."""

    config: EngineConfig
    block_manager: BlockManager
    kv_cache: torch.Tensor
    bytes_per_block: int
    block_size: int
    shard: Shard
    ranks: RankGroup | None
    device: torch.device
    model_dir: Path
    wake: Callable[[], None]

    def layout_fingerprint(self) -> dict[str, object]: ...


class KVOffload:
    def __init__(self, engine: Engine, tiers: KVTiers | None) -> None:
        self.tiers = tiers
        self.bm = engine.block_manager
        cache = engine.kv_cache
        self.raw = cache.view(cache.shape[0], -1).view(torch.uint8)  # each pool block's bytes
        self._wake = engine.wake
        # disk reads done (on the disk thread): (seq_id, pool blocks, their bytes or None, why)
        self._arrived: deque[tuple[str, list[int], list[np.ndarray] | None, str]] = deque()
        # what a tier's block costs to load against computing it, measured (load_cost.py)
        self.costs = LoadCosts(engine.block_size)
        self._timer = CopyTimer(self.costs, tiers is not None and tiers.cuda)
        # TP: what the other ranks copy of this step's tier work (parallel/tier_mirror.py)
        self.ranks = engine.ranks if tiers is not None else None
        self.mirror = None
        if tiers is not None:
            self.bm.tiers = tiers
            self.bm.on_evict = self._evicted
        if self.ranks is not None:
            self.mirror = TierLog(self.ranks.size - 1, tiers.host.num_slots, engine.bytes_per_block)
            tiers.ranks_sync = self._sync_ranks

    @classmethod
    def build(cls, engine: Engine) -> KVOffload:
        """The engine's offload: off (a pass-through) unless ``--kv-offload-ram-gib`` is set."""
        cfg = engine.config
        if cfg.kv_offload_ram_gib <= 0:
            if cfg.kv_offload_disk:
                raise StartupError(
                    "--kv-offload-disk needs --kv-offload-ram-gib > 0: blocks reach the disk "
                    "through host memory"
                )
            return cls(engine, None)
        block, shards = engine.bytes_per_block, engine.shard.size  # this rank's shard; ranks
        problem = (
            "needs the prefix cache: tier blocks are found by their prefix hashes"
            if not cfg.prefix_cache
            else f"{cfg.kv_offload_ram_gib} GiB holds no KV block ({block * shards} bytes)"
            if cfg.kv_offload_ram_gib * GIB < block * shards
            else f"--kv-offload-disk-gib {cfg.kv_offload_disk_gib} holds no KV block"
            if cfg.kv_offload_disk and cfg.kv_offload_disk_gib * GIB < 2 * block * shards
            else None
        )
        if problem is not None:
            raise StartupError(f"--kv-offload-ram-gib {problem}")
        if engine.ranks is not None and {r["block_bytes"] for r in engine.ranks.ready} != {block}:
            raise StartupError("--kv-offload-ram-gib: the TP ranks' blocks differ in size")
        # Pulls pair any two TP sizes (layout_id leaves the size out); a file holds the ranks'
        # shards one after another, which only the same TP size reads back as its own.
        shape = {"tier_shards": shards} if shards > 1 else {}
        layout = layout_id({**engine.layout_fingerprint(), **shape})
        disk = Path(cfg.kv_offload_disk) if cfg.kv_offload_disk else None
        # the disk files name the checkpoint too, digested on the disk thread (weights_digest.py)
        weights = partial(weights_digest, engine.model_dir, cfg.quantization) if disk else None
        tiers = KVTiers(
            block_bytes=block,
            layout=layout,
            ram_bytes=int(cfg.kv_offload_ram_gib * GIB),
            device=engine.device,
            disk_dir=disk,
            disk_bytes=int(cfg.kv_offload_disk_gib * GIB),
            weights=weights,
            shards=shards,
        )
        log.info(
            "KV offload: %d blocks of host memory%s%s%s",
            tiers.host.num_slots,
            " (pinned)" if tiers.cuda else "",
            f", then {disk} ({cfg.kv_offload_disk_gib} GiB, layout {layout})" if disk else "",
            f", a shard on each of {shards} ranks" if shards > 1 else "",
        )
        return cls(engine, tiers)

    # ---- the engine thread ---------------------------------------------------------------------

    def schedule(self, sch: Scheduler) -> ScheduledBatch | None:
        """The scheduler's pass with the tiers around it: disk loads that arrived go in first
        (their sequences may run in this very batch), then this pass's evictions settle and
        its loads start."""
        if self.tiers is None:
            return sch.schedule()
        self._timer.poll()  # the host copies of earlier steps that are done
        while self._arrived:
            self._copy_in(sch, *self._arrived.popleft())
        batch = sch.schedule()
        self._start_loads()
        # After the loads: at TP the ranks get this pass's copies, loads too, in one message.
        # (On CUDA the wait for the copies then waits for the loads as well.)
        self.tiers.settle()
        return batch

    def event_feed(self) -> KVEventFeed:
        """A feed of the pool's events and, with tiers, theirs (recorded from now on)."""
        if self.tiers is None:
            return KVEventFeed()
        self.tiers.enable_events()
        return KVEventFeed(("device", *self.tiers.names), self.tiers.log.take)

    def stats(self) -> TierStats | None:
        if self.tiers is None:
            return None
        costs = self.costs
        return replace(
            self.tiers.stats(), host_load_cost=costs.cost("host"), disk_load_cost=costs.cost("disk")
        )

    def observe_forward(self, stats: StepStats) -> None:
        """A forward pass ran: one that only prefilled prices computing a block."""
        if self.tiers is not None and stats.prefill_seqs and not stats.num_decodes:
            self.costs.observe_prefill(stats.num_tokens, stats.seconds)

    def load_fields(self) -> dict[str, float]:
        """``WorkerLoad``'s measured tier load costs (0: not measured, or no tiers)."""
        return self.costs.load_fields() if self.tiers is not None else {}

    def flush(self) -> None:
        """Wait for the disk tier's jobs posted so far: its start-up scan, the writes."""
        if self.tiers is not None:
            self.tiers.flush()

    def close(self) -> None:
        """Finish the disk tier's writes and stop its thread (tests, a clean shutdown)."""
        if self.tiers is not None:
            self.tiers.close()

    def _evicted(self, block_id: int, block_hash: int) -> None:
        slot = self.tiers.store(block_hash, self.raw[block_id])
        if slot is not None and self.mirror is not None:
            self.mirror.store(block_id, slot)

    def _sync_ranks(self, slots: list[int]) -> list[list[np.ndarray]]:
        """The other ranks do what this step's tier work asks of them (``settle``, after the
        copies here); their shards of ``slots``, rank 1's first."""
        if not (self.mirror or slots):
            return []
        return self.ranks.sync_tiers(self.mirror.take(slots))

    def _start_loads(self) -> None:
        loads, self.bm.loads = self.bm.loads, {}
        if not loads:
            return
        started, copied = self._timer.start(), 0
        for seq_id, pairs in loads.items():
            slow = [(block_id, claim) for block_id, claim in pairs if claim.slow]
            for block_id, claim in pairs:
                if not claim.slow:  # host memory: queued now, ahead of the forward pass
                    if self.mirror is not None:
                        self.mirror.load(claim.slot, block_id)
                    self.tiers.load_host(claim, self.raw[block_id])
                    copied += 1
            if slow:
                ids = [block_id for block_id, _ in slow]
                posted = time.perf_counter()

                def done(
                    blocks,
                    error: str,
                    seq_id: str = seq_id,
                    ids: list[int] = ids,
                    posted: float = posted,
                ) -> None:
                    if blocks is not None:  # the disk thread: what the sequence waited
                        self.costs.observe_load("disk", len(ids), time.perf_counter() - posted)
                    self._arrived.append((seq_id, ids, blocks, error))
                    self._wake()

                self.tiers.load_disk([claim for _, claim in slow], done)
        if copied:
            self._timer.stop(started, copied)

    def _copy_in(
        self,
        sch: Scheduler,
        seq_id: str,
        ids: list[int],
        blocks: list[np.ndarray] | None,
        error: str,
    ) -> None:
        if blocks is None:
            log.warning("KV load of %s failed, computing it instead: %s", seq_id, error)
        else:
            own = self.raw.shape[1]  # at TP, a file holds every rank's shard: ours first
            for block_id, data in zip(ids, blocks, strict=True):
                self.raw[block_id].copy_(torch.from_numpy(data[:own]))
                if self.mirror is not None:
                    self.mirror.put(block_id, data)
        sch.kv_loaded(seq_id, blocks is not None)
