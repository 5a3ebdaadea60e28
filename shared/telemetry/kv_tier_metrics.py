"""A worker's KV offload tiers in Prometheus (``--kv-offload-ram-gib``, ``--kv-offload-disk``),
beside ``pdserve_worker_prefix_cache_*``: the prefix cache's hits count pool and tier blocks
alike, and these series say which tier served them and what the tiers hold and threw away.

Read at scrape time from the engine's counters since start (``KVTiers.stats``, a snapshot the
scrape thread may take: plain integers, the disk index under its lock), so nothing is added to
a step. A worker without tiers exports none of these series.

    pdserve_worker_prefix_cache_tier_hits_total{tier}     prompt blocks found there and loaded
    pdserve_worker_prefix_cache_tier_blocks{tier}         blocks held now
    pdserve_worker_prefix_cache_offloaded_total           evicted pool blocks kept in host memory
    pdserve_worker_prefix_cache_offload_dropped_total     ... not kept (every host slot busy)
    pdserve_worker_prefix_cache_tier_load_failures_total  disk loads that failed (recomputed)
    pdserve_worker_prefix_cache_disk_writes_total         block files written
    pdserve_worker_prefix_cache_disk_removed_total        torn or corrupt files removed, unserved
    pdserve_worker_prefix_cache_disk_ignored_total        files of another KV layout, ignored
    pdserve_worker_prefix_cache_tier_load_cost{tier}      measured: a block's load / its compute
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pdserve_worker_prefix_cache_"


class TierStatsLike(Protocol):
    """``services/engine/kv_tiers.TierStats``, as far as the metrics read it."""

    host_hits: int
    disk_hits: int
    stored: int
    dropped: int
    load_failures: int
    host_blocks: int
    disk_blocks: int
    disk: Any  # DiskCounts: written, corrupt_removed, foreign_ignored


class KVTierCollector(Collector):
    """Series of the tiers ``stats`` returns (None: no engine yet, or no tiers)."""

    def __init__(self, role: str, stats: Callable[[], TierStatsLike | None]) -> None:
        self.role = role
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        hits = CounterMetricFamily(
            PREFIX + "tier_hits",
            "Prompt blocks found in a KV offload tier below the pool and loaded back.",
            labels=["role", "tier"],
        )
        held = GaugeMetricFamily(
            PREFIX + "tier_blocks", "KV blocks a KV offload tier holds.", labels=["role", "tier"]
        )
        for tier, hit, blocks in (
            ("host", s.host_hits, s.host_blocks),
            ("disk", s.disk_hits, s.disk_blocks),
        ):
            hits.add_metric([self.role, tier], hit)
            held.add_metric([self.role, tier], blocks)
        yield hits
        yield held
        for name, doc, value in (
            ("offloaded", "Evicted pool blocks copied to host memory.", s.stored),
            ("offload_dropped", "Evicted pool blocks not kept: every host slot busy.", s.dropped),
            (
                "tier_load_failures",
                "Disk loads that failed; the tokens were computed instead.",
                s.load_failures,
            ),
            ("disk_writes", "KV block files written.", s.disk.written),
            (
                "disk_removed",
                "Torn or corrupt KV block files removed, never served.",
                s.disk.corrupt_removed,
            ),
            (
                "disk_ignored",
                "KV block files of another KV layout, ignored.",
                s.disk.foreign_ignored,
            ),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
        cost = GaugeMetricFamily(
            PREFIX + "tier_load_cost",
            "Loading a block from a KV tier, as a fraction of computing it (measured; 0: not yet).",
            labels=["role", "tier"],
        )
        for tier in ("host", "disk"):
            cost.add_metric([self.role, tier], getattr(s, f"{tier}_load_cost", 0.0))
        yield cost
