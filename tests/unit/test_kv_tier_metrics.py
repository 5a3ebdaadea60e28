"""The KV offload tiers' Prometheus series (shared/telemetry/kv_tier_metrics.py), read from real
tiers (host memory and a disk directory) as a worker's /metrics renders them."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.engine.kv_tiers import KVTiers
from pdserve.shared.telemetry.kv_tier_metrics import KVTierCollector

BLOCK = 64


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_tier_series_follow_the_tiers(tmp_path) -> None:
    registry = CollectorRegistry()
    tiers: list[KVTiers] = []  # none yet: a worker before its engine started
    registry.register(KVTierCollector("decode", lambda: tiers[0].stats() if tiers else None))
    assert not any("tier" in name for name, _ in scrape(registry))

    tiers.append(
        KVTiers(BLOCK, "0123456789abcdef", 4 * BLOCK, torch.device("cpu"), tmp_path, 1 << 20)
    )
    t = tiers[0]
    for h in range(6):
        t.store(h, torch.full((BLOCK,), h, dtype=torch.uint8))
        t.settle()
        t.disk.flush()
    t.claim(5)  # in host memory
    t.claim(0)  # only on disk now
    (tmp_path / "0000000000000009.fedcba9876543210.kv").write_bytes(b"another layout's")
    t.close()
    tiers[0] = KVTiers(BLOCK, "0123456789abcdef", 4 * BLOCK, torch.device("cpu"), tmp_path, 1 << 20)
    again = tiers[0]
    again.flush()  # its scan
    restarted = scrape(registry)
    tiers[0] = t
    got = scrape(registry)
    role = ("role", "decode")
    host, disk = (role, ("tier", "host")), (role, ("tier", "disk"))
    assert got["pdserve_worker_prefix_cache_tier_hits_total", host] == 1
    assert got["pdserve_worker_prefix_cache_tier_hits_total", disk] == 1
    assert got["pdserve_worker_prefix_cache_tier_blocks", host] == 4
    assert got["pdserve_worker_prefix_cache_tier_blocks", disk] == 6
    assert got["pdserve_worker_prefix_cache_offloaded_total", (role,)] == 6
    assert got["pdserve_worker_prefix_cache_disk_writes_total", (role,)] == 6
    assert got["pdserve_worker_prefix_cache_offload_dropped_total", (role,)] == 0
    assert restarted["pdserve_worker_prefix_cache_disk_ignored_total", (role,)] == 1
    assert restarted["pdserve_worker_prefix_cache_tier_blocks", disk] == 6
    tiers[0] = KVTiers(BLOCK, "0123456789abcdef", 4 * BLOCK, torch.device("cpu"))
    assert scrape(registry)["pdserve_worker_prefix_cache_tier_blocks", disk] == 0
    again.close()
