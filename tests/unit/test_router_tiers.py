"""The router knows the KV tiers (issue 33): the registry keeps one hash set per worker and tier,
fed by a worker's per-tier KVEvents (a real KVEventFeed with tier events, a real publisher), and
prefill routing prefers a device hit, then host memory, then disk, then none, by each tier's
load cost (measured by the worker when it reports one)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.gateway.router import DEFAULT_LOAD_COST, Router
from pdserve.services.engine.commands import KVEventFeed
from pdserve.services.engine.kv_tiers.tier_events import TierEventLog
from pdserve.shared.bus.discovery_messages import KVEvents, WorkerLoad
from pdserve.shared.bus.protocol import decode, encode
from pdserve.shared.discovery.announce import KVEventPublisher
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from pdserve.shared.kv.layout import prefix_block_hashes

BS = 16
MODEL = "m"
TIERS = ("device", "host", "disk")


def load(wid: str, instance: str = "i1", **kw) -> WorkerLoad:
    return WorkerLoad(
        wid,
        "prefill",
        MODEL,
        100,
        100,
        0,
        0,
        ts=time.time(),
        block_size=BS,
        instance=instance,
        **kw,
    )


class _Sink:
    """A bus that hands what the publisher sends to the registry, through the wire codec."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.sent: list[KVEvents] = []

    async def publish(self, subject: str, msg: KVEvents) -> None:
        msg = decode(encode(msg))
        self.sent.append(msg)
        await self.registry._on_kv_events(msg, {})


async def publish(pub: KVEventPublisher, snapshot: bool = False) -> None:
    for msg in pub.messages(snapshot):
        await pub.bus.publish("unused", msg)


@pytest.fixture
async def worker():
    registry = WorkerRegistry(bus=None, timeout=60.0)  # type: ignore[arg-type]
    await registry._on_message(load("p0"), {})
    log = TierEventLog()
    log.enabled = True
    feed = KVEventFeed(TIERS, log.take)
    pub = KVEventPublisher(
        _Sink(registry), "p0", "i1", BS, feed.drain, feed.snapshot, 1.0, tiers=feed.tiers
    )
    return registry, feed, log, pub


async def test_the_registry_keeps_each_tier_and_follows_a_move(worker):
    registry, feed, log, pub = worker
    hashes = prefix_block_hashes(list(range(4 * BS)), BS)
    feed.push(hashes[:2], [])
    log.add("host", True, [hashes[2]])
    log.add("disk", True, hashes[2:])
    await publish(pub)
    assert {m.tier for m in pub.bus.sent} == set(TIERS)
    assert registry.tier_chain("p0", hashes) == ["device", "device", "host", "disk"]
    assert registry.prefix_hits("p0", hashes) == 2  # the device pool alone
    # the pool evicts block 1: it moves to host memory (removed there, stored here)
    feed.push([], [hashes[1]])
    log.add("host", True, [hashes[1]])
    await publish(pub)
    assert registry.tier_chain("p0", hashes) == ["device", "host", "host", "disk"]
    # host memory forgets both (still on disk for block 2), the disk deletes block 3's file
    log.add("host", False, hashes[1:3])
    log.add("disk", False, [hashes[3]])
    await publish(pub)
    assert registry.tier_chain("p0", hashes) == ["device"]  # block 1 is nowhere: the chain ends
    assert registry.cached_blocks("p0", "disk").hashes == {hashes[2]}


async def test_each_tier_snapshot_replaces_only_that_tier(worker, monkeypatch):
    import pdserve.shared.discovery.kv_publisher as announce  # the publisher's home

    monkeypatch.setattr(announce, "MAX_KV_EVENT_HASHES", 3)
    registry, feed, log, pub = worker
    feed.push(list(range(1, 8)), [])
    log.add("disk", True, range(100, 105))
    msgs = pub.messages(snapshot=True)  # per tier, in parts: device 3 parts, host 1, disk 2
    assert [(m.tier, m.part, m.parts) for m in msgs] == [
        ("device", 0, 3),
        ("device", 1, 3),
        ("device", 2, 3),
        ("host", 0, 1),
        ("disk", 0, 2),
        ("disk", 1, 2),
    ]
    for msg in msgs:
        if (msg.tier, msg.part) != ("disk", 1):  # lost: the disk keeps its previous set
            await pub.bus.publish("unused", msg)
    assert registry.cached_blocks("p0", "device").hashes == set(range(1, 8))
    assert registry.cached_blocks("p0", "disk").hashes == set()
    await publish(pub, snapshot=True)
    assert registry.cached_blocks("p0", "disk").hashes == set(range(100, 105))
    # a restarted worker (new instance) starts from nothing in every tier
    await registry._on_message(load("p0", instance="i2"), {})
    assert registry.tier_chain("p0", [1]) == [] and registry.cached_blocks("p0", "disk") is None


def router_over(workers: list[WorkerLoad], tiers: dict[str, dict[str, set[int]]]) -> Router:
    def chain(worker_id: str, hashes: list[int]) -> list[str]:
        held = tiers.get(worker_id, {})
        out = []
        for h in hashes:
            tier = next((t for t in TIERS if h in held.get(t, set())), None)
            if tier is None:
                break
            out.append(tier)
        return out

    return Router(lambda role: list(workers), BS, model=MODEL, cached_tiers=chain)


def test_routing_prefers_device_then_host_then_disk_then_none():
    prompt = list(range(1000, 1000 + 8 * BS)) + [1, 2, 3]
    held = set(prefix_block_hashes(prompt, BS))
    workers = [load("none"), load("disk"), load("host"), load("device")]
    router = router_over(workers, {t: {t: held} for t in TIERS})
    costs = router.prefill_costs(prompt)
    assert costs["device"] < costs["host"] < costs["disk"] < costs["none"]
    # by as much as each tier's default load cost says, per block
    per_block = {t: (costs[t] - costs["device"]) / (router.prefix_weight * 8) for t in TIERS}
    assert per_block == pytest.approx(DEFAULT_LOAD_COST)
    assert router.pick_prefill(prompt) == "device"
    workers.pop()
    assert router.pick_prefill(prompt) == "host"
    # a worker that measured its disk loads as cheaper than the default host cost wins
    workers[1] = replace(workers[1], kv_disk_load_cost=DEFAULT_LOAD_COST["host"] / 2)
    assert router.pick_prefill(prompt) == "disk"


def test_a_chain_across_tiers_costs_each_block_by_its_tier():
    prompt = list(range(2000, 2000 + 4 * BS)) + [9]
    hashes = prefix_block_hashes(prompt, BS)
    workers = [load("mixed"), load("host")]
    router = router_over(
        workers,
        {
            "mixed": {"device": set(hashes[:2]), "disk": set(hashes[2:])},
            "host": {"host": set(hashes)},
        },
    )
    costs = router.prefill_costs(prompt)
    w = router.prefix_weight
    assert costs["mixed"] == pytest.approx(w * (1 + 2 * DEFAULT_LOAD_COST["disk"]))
    assert costs["host"] == pytest.approx(w * (1 + 4 * DEFAULT_LOAD_COST["host"]))
    assert router.pick_prefill(prompt) == "host"  # 0.4 < 1.0 blocks' worth of loading
