"""KV-aware prefill routing: the router's cost model over real prefix hashes and a real
registry's cache sets (fed with the KVEvents workers publish)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

from pdserve.gateway.router import Router
from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.bus.discovery_messages import KVEvents, WorkerLoad
from pdserve.shared.discovery.announce import KVEventPublisher
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from pdserve.shared.kv.layout import layout_id, prefix_block_hashes
from pdserve.shared.kv.tp_layout import TP_KEY
from pdserve.shared.sampling import SamplingParams

BS = 16
MODEL = "m"


def load(wid: str, waiting: int = 0, running: int = 0, instance: str = "i1") -> WorkerLoad:
    return WorkerLoad(
        wid,
        "prefill",
        MODEL,
        100,
        100,
        running,
        waiting,
        ts=time.time(),
        block_size=BS,
        instance=instance,
    )


def router_over(workers: list[WorkerLoad], cached: dict[str, set[int]]) -> Router:
    def hits(worker_id: str, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in cached.get(worker_id, set()):
                break
            n += 1
        return n

    return Router(lambda role: list(workers), BS, model=MODEL, cached_hits=hits)


def test_picks_the_worker_holding_the_prefix():
    system = list(range(1000, 1000 + 8 * BS))  # 8 blocks
    workers = [load("p0"), load("p1"), load("p2")]
    cached = {"p1": set(prefix_block_hashes(system, BS))}
    router = router_over(workers, cached)
    prompt = system + [7, 8, 9]
    costs = router.prefill_costs(prompt)
    assert costs["p1"] < costs["p0"] == costs["p2"]
    assert router.pick_prefill(prompt, bus_id="r1") == "p1"
    router.prefill_done("r1")
    # held prefix beats a little queued work ...
    workers[1].waiting = 1
    assert router.pick_prefill(system + [4], bus_id="r2") == "p1"
    router.prefill_done("r2")
    # ... but not a long queue: a cache hit is not worth waiting behind many prompts
    workers[1].waiting = 20
    assert router.pick_prefill(system + [5]) != "p1"


def test_only_leading_blocks_count_and_partial_blocks_never():
    prompt = list(range(3 * BS + 5))
    hashes = prefix_block_hashes(prompt, BS)
    workers = [load("p0"), load("p1")]
    # p0 holds blocks 2 and 3 but not the first: useless (the chain breaks at a miss)
    router = router_over(workers, {"p0": set(hashes[1:]), "p1": {hashes[0]}})
    costs = router.prefill_costs(prompt)
    assert costs["p1"] == costs["p0"] - 1 * router.prefix_weight
    # a fully cached prompt still computes its last block (the worker needs its logits)
    exact = list(range(2 * BS))
    full = router_over(workers, {"p0": set(prefix_block_hashes(exact, BS))})
    assert full.prefill_costs(exact)["p0"] == full.prefill_costs(exact)["p1"] - 1 * 2.0


def test_a_prefix_every_worker_holds_does_not_herd():
    system = list(range(5000, 5000 + 10 * BS))
    workers = [load("p0"), load("p1"), load("p2")]
    everywhere = set(prefix_block_hashes(system, BS))
    router = router_over(workers, {w.worker_id: everywhere for w in workers})
    # a burst between two heartbeats: only what this router sent tells the workers apart
    picks = Counter(router.pick_prefill(system + [i, i + 1, i + 2]) for i in range(30))
    assert set(picks) == {"p0", "p1", "p2"} and max(picks.values()) - min(picks.values()) <= 1
    # and a reported queue moves work away from a busy holder
    for w in workers:
        w.ts = time.time() + 1  # fresh reports: this router's sends are in them now
    workers[0].waiting = 5
    picks = Counter(router.pick_prefill(system + [i]) for i in range(4))
    assert "p0" not in picks


def test_a_prefix_just_sent_counts_before_the_workers_events_arrive():
    chat = list(range(300, 300 + 6 * BS))
    workers = [load("p0"), load("p1")]
    router = router_over(workers, {})
    first = router.pick_prefill(chat + [1], bus_id="turn-1")
    router.prefill_done("turn-1")
    # the worker's report still shows the finished prefill as running (it lags a heartbeat)
    next(w for w in workers if w.worker_id == first).running = 1
    assert router.pick_prefill(chat + [1, 50, 51, 52], bus_id="turn-2") == first


class _Sink:
    """Stands in for the bus: hands published KVEvents straight to a registry."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.sent: list[KVEvents] = []

    async def publish(self, subject: str, msg: KVEvents) -> None:
        self.sent.append(msg)
        await self.registry._on_kv_events(msg, {})


async def test_events_and_evictions_reach_the_registry_and_the_router():
    registry = WorkerRegistry(bus=None, timeout=60.0)  # type: ignore[arg-type]
    for wid in ("p0", "p1"):
        await registry._on_message(load(wid), {})
    bm = BlockManager(num_blocks=4, block_size=BS)
    sink = _Sink(registry)
    pub = KVEventPublisher(
        sink, "p0", "i1", BS, bm.drain_events, lambda: list(bm.hash_to_block), 1.0
    )
    router = Router(lambda role: registry.routable(role), BS, cached_hits=registry.prefix_hits)

    prompt = list(range(3 * BS))
    seq = Sequence("a", prompt, SamplingParams(), 0, 0.0)
    bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.commit(seq)
    bm.free_sequence(seq)
    await _publish(pub, snapshot=False)
    assert registry.prefix_hits("p0", prefix_block_hashes(prompt, BS)) == 3
    assert router.pick_prefill(prompt + [1]) == "p0"

    # memory pressure: another prompt needs every block, so the cached ones are evicted
    other = Sequence("b", list(range(900, 900 + 4 * BS)), SamplingParams(), 0, 0.0)
    bm.allocate(other, 4 * BS)
    await _publish(pub, snapshot=False)
    assert registry.prefix_hits("p0", prefix_block_hashes(prompt, BS)) == 0
    assert sink.sent[-1].removed and not sink.sent[-1].stored

    # a late gateway that missed everything converges on the next snapshot
    registry.cached.clear()
    other.num_computed_tokens = 4 * BS
    bm.commit(other)
    bm.drain_events()  # this delta is lost
    await _publish(pub, snapshot=True)
    assert registry.prefix_hits("p0", prefix_block_hashes(other.token_ids, BS)) == 4

    # a restarted worker (new instance) starts from nothing; its old events are ignored
    await registry._on_message(load("p0", instance="i2"), {})
    assert registry.cached_blocks("p0") is None
    await _publish(pub, snapshot=True)  # still the old instance's id
    assert registry.cached_blocks("p0") is None


async def test_snapshots_split_over_parts_apply_only_when_complete(monkeypatch):
    import pdserve.shared.discovery.kv_publisher as announce  # the publisher's home

    monkeypatch.setattr(announce, "MAX_KV_EVENT_HASHES", 3)
    registry = WorkerRegistry(bus=None, timeout=60.0)  # type: ignore[arg-type]
    await registry._on_message(load("p0"), {})
    sink = _Sink(registry)
    hashes = list(range(10, 18))
    pub = KVEventPublisher(sink, "p0", "i1", BS, lambda: ([], []), lambda: hashes, 1.0)
    parts = pub.messages(snapshot=True)
    assert [m.parts for m in parts] == [3, 3, 3] and [m.part for m in parts] == [0, 1, 2]
    for msg in parts[:2]:
        await registry._on_kv_events(msg, {})
    assert registry.cached_blocks("p0").hashes == set()  # incomplete: not applied yet
    await registry._on_kv_events(parts[2], {})
    assert registry.cached_blocks("p0").hashes == set(hashes)
    # a lost part leaves the previous set in place
    hashes[:] = [1, 2, 3, 4]
    lost = pub.messages(snapshot=True)
    await registry._on_kv_events(lost[1], {})
    assert registry.cached_blocks("p0").hashes == set(range(10, 18))


async def _publish(pub: KVEventPublisher, snapshot: bool) -> None:
    for msg in pub.messages(snapshot):
        await pub.bus.publish("unused", msg)
    await asyncio.sleep(0)


def test_round_robin_baseline_ignores_the_cache():
    system = list(range(1000, 1000 + 8 * BS))
    workers = [load("p0"), load("p1")]
    router = router_over(workers, {"p1": set(prefix_block_hashes(system, BS))})
    router.prefill_policy = "round-robin"
    picks = [router.pick_prefill(system + [i]) for i in range(4)]
    assert picks == ["p0", "p1", "p0", "p1"]


def decode_load(wid: str, running: int = 0, free: int = 1000) -> WorkerLoad:
    return WorkerLoad(wid, "decode", MODEL, free, 1000, running, 0, ts=time.time(), block_size=BS)


def test_a_decode_burst_splits_evenly_between_heartbeats():
    """Reports lag a heartbeat: what this gateway has in flight on each worker decides a burst
    (it once split 8 streams 7:1), and requests leave the count when they end."""
    for burst in (8, 16, 32):
        workers = [decode_load("d0"), decode_load("d1", free=990)]
        router = Router(lambda role, ws=workers: ws, BS, model=MODEL)
        picks = Counter(router.pick_decode(200, bus_id=f"r{i}") for i in range(burst))
        assert abs(picks["d0"] - picks["d1"]) <= 1, (burst, picks)
    # d0's requests end: the next ones go there, even though no report says so yet
    for i in range(0, 32, 2):
        if router._in_decode.get(f"r{i}") == "d0":
            router.decode_done(f"r{i}")
    assert {router.pick_decode(200, bus_id=f"s{i}") for i in range(4)} == {"d0"}
    # a retry moves the request: it no longer counts where it was refused
    first = router.pick_decode(200, bus_id="moved")
    counted = router._decoding[first]
    again = router.pick_decode(200, exclude={first}, bus_id="moved")
    assert router._in_decode["moved"] == again != first
    assert router._decoding[first] == counted - 1


def test_decode_reports_of_other_gateways_still_count():
    # another gateway's 5 requests on d0 show only in d0's report: d1 takes the next ones
    workers = [decode_load("d0", running=5), decode_load("d1")]
    router = Router(lambda role: workers, BS, model=MODEL)
    assert [router.pick_decode(100, bus_id=f"r{i}") for i in range(5)] == ["d1"] * 5
    # a worker without room for the request loses to one that has it, however busy
    workers[1] = decode_load("d1", free=2)
    assert router.pick_decode(100, bus_id="big") == "d0"


def test_prefill_and_decode_pair_only_where_the_blocks_fit():
    """A fleet changing --kv-cache-dtype: p-int8's blocks go to d-int8 even though d-float is
    idler, and a prefill worker no decode worker could pull from is passed over."""
    int8 = layout_id({"model": MODEL, "kv_dtype": "int8"})
    flt = layout_id({"model": MODEL, "kv_dtype": "float32"})
    other = layout_id({"model": MODEL, "kv_dtype": "float8_e4m3fn"})
    decode = [
        replace(decode_load("d-int8", running=6), kv_layout=int8),
        replace(decode_load("d-float"), kv_layout=flt),
    ]
    prefill = [replace(load("p-fp8"), kv_layout=other), replace(load("p-int8", 9), kv_layout=int8)]
    router = Router(lambda role: prefill if role == "prefill" else decode, BS, model=MODEL)
    assert router.pick_decode(100, kv_layout=int8) == "d-int8"
    assert router.pick_decode(100, kv_layout=flt) == "d-float"
    assert router.pick_decode(100) == "d-float"  # local prefill: nothing to pull, least busy
    # no decode worker can pull fp8 blocks: the busier int8 prefill worker takes the prompt
    assert router.pick_prefill(list(range(40))) == "p-int8"
    # nobody fits at all: still routed, and the pull's refusal names the mismatch
    assert router.pick_decode(100, kv_layout=other) == "d-float"
    # a worker that advertises no layout (an older version) pairs with anything
    decode[0] = replace(decode[0], kv_layout="")
    assert router.pick_prefill(list(range(40, 80))) == "p-fp8"


def test_layout_id_is_stable_and_order_free():
    a = {"model": MODEL, "dtype": "float32", "block_size": 16, "kv_dtype": "int8"}
    assert layout_id(a) == layout_id(dict(reversed(list(a.items()))))
    assert layout_id(a) != layout_id({**a, "kv_dtype": "float32"})
    assert len(layout_id(a)) == 16


def test_tp_sizes_pair_where_head_sliced_pulls_bridge_them():
    """A TP-2 prefill worker's blocks go to TP-1 decode workers of the same layout: each decode
    rank pulls its heads from whichever prefill ranks hold them (shared/kv/tp_layout.py)."""
    base = {"model": MODEL, "dtype": "float32", "block_size": 16, "num_kv_heads": 4}
    tp1, tp2 = layout_id({**base, TP_KEY: 1}), layout_id({**base, TP_KEY: 2})
    assert tp1 == tp2 == layout_id(base)
    decode = [
        replace(decode_load("d-tp1"), kv_layout=tp1),
        replace(decode_load("d-int8"), kv_layout=layout_id({**base, "kv_dtype": "int8"})),
    ]
    router = Router(lambda role: [] if role == "prefill" else decode, BS, model=MODEL)
    assert router.pick_decode(100, kv_layout=tp2) == "d-tp1"
