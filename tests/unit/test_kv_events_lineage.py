"""KV events with lineage and clears (issue 33): BlockStored's parent hash and token ids ride in
``KVEvents`` from a real BlockManager through the feed (a block evicted to host memory keeps
them) and the publisher (split within the size bounds, all-or-nothing per message); a clear is
AllBlocksCleared, and the gateway's registry drops that tier before the message applies."""

from __future__ import annotations

import time

import msgpack
import pytest

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.kv_event_feed import KVEventFeed
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.bus.discovery_messages import MAX_ADAPTERS, KVEvents, WorkerLoad
from pdserve.shared.bus.protocol import ProtocolError, decode, encode
from pdserve.shared.bus.wire_fields import (
    MAX_ADAPTER_CHARS,
    MAX_KV_EVENT_HASHES,
    MAX_KV_EVENT_TOKENS,
)
from pdserve.shared.discovery.kv_delta import KVDelta
from pdserve.shared.discovery.kv_publisher import KVEventPublisher
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from pdserve.shared.kv.layout import ROOT_HASH, hash_block, prefix_block_hashes
from pdserve.shared.sampling import SamplingParams

BS = 4


def commit(bm: BlockManager, rid: str, tokens: list[int]) -> Sequence:
    s = Sequence(rid, tokens, SamplingParams(), 0, 0.0)
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return s


def step(bm: BlockManager, feed: KVEventFeed) -> None:
    """What the engine's ``_publish`` does at the end of a step."""
    stored, removed = bm.drain_events()
    if stored or removed:
        feed.push(stored, removed, bm.take_lineage(stored))


# ---- protocol ----------------------------------------------------------------------------------


def test_lineage_and_clears_round_trip():
    msg = KVEvents(
        "p0",
        "i1",
        2,
        3,
        [11, 12],
        [7],
        parents=[ROOT_HASH, 11],
        token_ids=[1, 2, 3, 4],
        cleared=True,
        tier="host",
    )
    assert decode(encode(msg)) == msg
    old = KVEvents("p0", "i1", 2, 4, [11], [])  # without lineage: the fields' defaults
    assert decode(encode(old)).parents == [] and not decode(encode(old)).cleared
    under = KVEvents(
        worker_id="p0",
        instance="i1",
        block_size=2,
        seq=5,
        stored=[11, 12],
        removed=[],
        parents=[ROOT_HASH, 11],
        token_ids=[1, 2, 3, 4],
        lora_names=["sql"],
        lora_index=[1, 0],
    )
    assert decode(encode(under)) == under


LINEAGE = {"parents": [0, 11], "token_ids": [1, 2, 3, 4]}


@pytest.mark.parametrize(
    "fields",
    [
        {"parents": [0], "token_ids": [1, 2, 3, 4]},  # a parent short
        {"parents": [0, 11], "token_ids": [1, 2, 3]},  # a token short
        {"parents": [0, 11], "token_ids": [1, 2, 3, 4], "snapshot": True},  # snapshots: none
        {"token_ids": [1] * (MAX_KV_EVENT_TOKENS + 1)},  # over the bound
        {"lora_names": ["a"], "lora_index": [1, 1]},  # adapters without lineage
        {**LINEAGE, "lora_names": ["a"], "lora_index": [1]},  # an index short
        {**LINEAGE, "lora_names": ["a"], "lora_index": [1, 2]},  # past the names
        {**LINEAGE, "lora_names": [""], "lora_index": [1, 0]},  # an empty name
        {**LINEAGE, "lora_names": ["a" * 257], "lora_index": [1, 0]},  # too long a name
    ],
)
def test_decoder_refuses_lineage_that_does_not_fit(fields):
    body = msgpack.unpackb(encode(KVEvents("p0", "i1", 2, 3, [11, 12], [])))
    body.update(fields)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(body))


# ---- block manager and feed --------------------------------------------------------------------


def test_lineage_follows_blocks_from_the_pool_to_host_memory():
    bm = BlockManager(num_blocks=2, block_size=BS)
    host_events: list[tuple[str, bool, int]] = []
    feed = KVEventFeed(("device", "host"), lambda: [host_events.pop(0) for _ in list(host_events)])
    tokens = list(range(100, 108))
    first, second = prefix_block_hashes(tokens, BS)
    bm.free_sequence(commit(bm, "a", tokens))
    step(bm, feed)
    delta = feed.drain_delta()
    assert delta.stored == [first, second]
    assert delta.lineage[first][0] == ROOT_HASH and list(delta.lineage[first][1]) == tokens[:4]
    assert delta.lineage[second][0] == first and list(delta.lineage[second][1]) == tokens[4:]
    # the chained hash of each block is its parent's and its tokens' (what a consumer checks)
    for h, (parent, toks, _) in delta.lineage.items():
        assert hash_block(parent, list(toks)) == h

    # the pool evicts both (another prompt needs the blocks); host memory takes them
    commit(bm, "b", list(range(200, 208)))
    host_events += [("host", True, first), ("host", True, second)]
    step(bm, feed)
    assert set(feed.drain_delta().removed) == {first, second}
    host = feed.drain_delta("host")
    assert host.stored == [first, second] and host.lineage[second][0] == first

    # gone from every tier: the lineage is forgotten
    host_events += [("host", False, first)]
    feed.drain_delta("host")
    assert first not in feed._lineage and second in feed._lineage


def test_a_clear_empties_the_tier_and_says_so_once():
    bm = BlockManager(num_blocks=4, block_size=BS)
    feed = KVEventFeed()
    commit(bm, "a", list(range(8)))
    step(bm, feed)
    feed.clear()
    commit(bm, "b", list(range(50, 54)))
    step(bm, feed)
    delta = feed.drain_delta()
    assert delta.cleared and delta.stored == prefix_block_hashes(list(range(50, 54)), BS)
    assert set(feed.snapshot()) == set(delta.stored)  # what came before the clear is gone
    assert not feed.drain_delta().cleared


# ---- publisher and registry ---------------------------------------------------------------------


class Sink:
    """Stands in for the bus: hands published KVEvents to a registry after a wire round trip."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.sent: list[KVEvents] = []

    async def publish(self, subject: str, msg: KVEvents) -> None:
        msg = decode(encode(msg))
        self.sent.append(msg)
        await self.registry._on_kv_events(msg, {})


async def publish(pub: KVEventPublisher, sink: Sink) -> None:
    for msg in pub.messages(snapshot=False):
        await sink.publish("unused", msg)


def load(wid: str) -> WorkerLoad:
    return WorkerLoad(
        wid, "prefill", "m", 100, 100, 0, 0, ts=time.time(), block_size=BS, instance="i1"
    )


def test_big_deltas_split_within_the_bounds_and_keep_lineage_whole():
    """Every bound at once: the most hashes and tokens, and more adapters (of the longest
    names) than one message may name; each block keeps its own adapter."""
    n = MAX_KV_EVENT_HASHES
    known = list(range(1, n + 1))
    unknown = list(range(10 * n, 10 * n + 100))
    names = [f"{i:03d}" + "x" * (MAX_ADAPTER_CHARS - 3) for i in range(MAX_ADAPTERS + 44)]
    adapter = {h: None if h % 2 else names[h % len(names)] for h in known}
    lineage = {h: (h - 1, [h % 1000] * BS, adapter[h]) for h in known}
    delta = KVDelta(known + unknown, list(range(20 * n, 20 * n + n)), True, lineage)
    pub = KVEventPublisher(None, "p0", "i1", BS, lambda: delta, lambda: [], 1.0)  # type: ignore[arg-type]
    msgs = pub.messages(snapshot=False)
    assert [m.cleared for m in msgs] == [True] + [False] * (len(msgs) - 1)
    for m in msgs:
        assert len(m.stored) + len(m.parents) + len(m.removed) <= n
        assert len(m.token_ids) <= MAX_KV_EVENT_TOKENS
        assert len(encode(m)) < 1 << 20  # NATS's default payload limit
        if m.parents:
            assert all(lineage[h][0] == p for h, p in zip(m.stored, m.parents, strict=True))
            assert len(m.lora_names) <= MAX_ADAPTERS
            got = [[None, *m.lora_names][i] for i in m.lora_index]
            assert got == [adapter[h] for h in m.stored]
        else:
            assert set(m.stored) <= set(unknown)
    assert sorted(h for m in msgs for h in m.stored) == sorted(known + unknown)
    assert sorted(h for m in msgs for h in m.removed) == list(range(20 * n, 21 * n))


async def test_registry_drops_a_cleared_tier_then_applies_the_message():
    registry = WorkerRegistry(bus=None, timeout=60.0)  # type: ignore[arg-type]
    await registry._on_message(load("p0"), {})
    bm = BlockManager(num_blocks=8, block_size=BS)
    feed = KVEventFeed(("device", "host"), lambda: [])
    sink = Sink(registry)
    pub = KVEventPublisher(
        sink,
        "p0",
        "i1",
        BS,
        feed.drain_delta,
        feed.snapshot,
        1.0,  # type: ignore[arg-type]
        tiers=feed.tiers,
    )
    a = list(range(8))
    commit(bm, "a", a)
    step(bm, feed)
    await publish(pub, sink)
    assert registry.prefix_hits("p0", prefix_block_hashes(a, BS)) == 2
    assert sink.sent[-1].parents[0] == ROOT_HASH and sink.sent[-1].token_ids == a
    registry.cached["p0"]["host"] = registry.cached["p0"]["device"].__class__("i1", BS, {99})

    feed.clear()  # e.g. the prefix cache reset; a new prompt lands after it
    b = list(range(40, 44))
    commit(bm, "b", b)
    step(bm, feed)
    await publish(pub, sink)
    cleared = [m for m in sink.sent if m.cleared]
    assert len(cleared) == 1 and cleared[0].tier == "device"
    assert registry.cached_blocks("p0").hashes == set(prefix_block_hashes(b, BS))
    assert registry.cached_blocks("p0", "host").hashes == {99}  # other tiers keep theirs
