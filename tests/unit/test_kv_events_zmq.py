"""KV events in vLLM's format over ZMQ (``--kv-events-zmq``; shared/discovery/vllm_kv_events.py):
a real SUB socket receives what a real KVEventPublisher, fed by a real BlockManager and
KVEventFeed, hands its ZMQ listener, and decodes it with plain msgpack against a transcription
of vLLM's structs (vllm/distributed/kv_events.py at 0181ea3173e5, and before PR #42892 for the
array form): framing, tags, field names and order, hashes, parents, token ids and media."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.kv_event_feed import KVEventFeed
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.discovery.kv_publisher import KVEventPublisher
from pdserve.shared.discovery.vllm_kv_events import DropOldest, ZmqKVEventPublisher
from pdserve.shared.kv.layout import ROOT_HASH, hash_block, identity_keys, prefix_block_hashes
from pdserve.shared.sampling import SamplingParams

BS = 4
TOPIC = "kv-events"
# vLLM's event structs: (fields without a default, in order; fields with one, in order)
VLLM = {
    "BlockStored": (
        [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ],
        ["extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"],
    ),
    "BlockRemoved": (["block_hashes", "medium"], ["group_idx"]),
    "AllBlocksCleared": ([], []),
}


def vllm_event(raw, fmt: str) -> dict:
    """One event as vLLM's decoder reads it: the tagged map (current) or tagged array (<=0.23)."""
    if fmt == "map":
        assert isinstance(raw, dict)
        required, optional = VLLM[raw["type"]]
        assert set(required) <= set(raw) - {"type"} <= set(required) | set(optional)
        return raw
    assert isinstance(raw, list)
    required, optional = VLLM[raw[0]]
    assert len(required) <= len(raw) - 1 <= len(required) + len(optional)
    return {"type": raw[0], **dict(zip(required + optional, raw[1:], strict=False))}


def vllm_batch(payload: bytes, fmt: str) -> tuple[float, list[dict], int]:
    """KVEventBatch (array_like): [ts, events, data_parallel_rank]."""
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and isinstance(rank, int)
    return ts, [vllm_event(e, fmt) for e in events], rank


class Subscriber:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def recv(self, timeout_ms: int = 2000) -> tuple[int, bytes] | None:
        if not self.sock.poll(timeout_ms):
            return None
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        return int.from_bytes(seq, "big"), payload

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class NoBus:
    subjects = SimpleNamespace(kv=lambda worker: f"pdserve.kv.{worker}")

    async def publish(self, subject: str, msg) -> None:
        pass


def commit(bm: BlockManager, rid: str, tokens: list[int], lora: str | None = None) -> Sequence:
    s = Sequence(rid, tokens, SamplingParams(), 0, 0.0)
    s.lora_name = lora  # as the scheduler sets it for a request under an adapter
    bm.attach_prefix(s, bm.find_prefix(s))  # as admission does: cached blocks are reused
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return s


@pytest.fixture
def sub():
    s = Subscriber()
    yield s
    s.close()


@pytest.mark.parametrize("fmt", ["map", "array"])
async def test_a_zmq_subscriber_reads_vllm_events(sub, fmt):
    zpub = ZmqKVEventPublisher(f"tcp://127.0.0.1:{sub.port}", TOPIC, fmt)
    try:
        # PUB drops what it sends before the subscription reaches it: probe until it did
        for _ in range(100):
            zpub.put([{"type": "AllBlocksCleared"}])
            if sub.recv(50) is not None:
                break
        while sub.recv(100) is not None:
            pass
        base = zpub.seq

        bm = BlockManager(num_blocks=3, block_size=BS)
        tier_events: list[tuple[str, bool, int]] = []
        feed = KVEventFeed(
            ("device", "host"), lambda: [tier_events.pop(0) for _ in list(tier_events)]
        )
        pub = KVEventPublisher(
            NoBus(),
            "p0",
            "i1",
            BS,
            feed.drain_delta,
            feed.snapshot,
            1.0,  # type: ignore[arg-type]
            tiers=feed.tiers,
            listeners=(zpub,),
        )

        def step() -> None:  # the engine's end of step
            stored, removed = bm.drain_events()
            feed.push(stored, removed, bm.take_lineage(stored))

        got: list[list[dict]] = []

        async def publish(snapshot: bool = False) -> None:
            await pub.publish_now(snapshot)
            seq, payload = sub.recv()
            assert seq == base + len(got)  # one batch per round, counted from 0 (big-endian)
            ts, events, rank = vllm_batch(payload, fmt)
            assert abs(ts - time.time()) < 60 and rank == 0
            got.append(events)

        await publish(snapshot=True)  # the worker's first batch: forget what came before
        assert got[-1] == [{"type": "AllBlocksCleared"}]

        a = list(range(100, 108))
        h1, h2 = prefix_block_hashes(a, BS)
        bm.free_sequence(commit(bm, "a", a))
        step()
        await publish()
        (stored,) = got[-1]
        assert stored["type"] == "BlockStored" and stored["block_hashes"] == [h1, h2]
        assert stored["parent_block_hash"] is None and stored["token_ids"] == a
        assert stored["block_size"] == BS and stored["medium"] == "GPU"
        assert stored["lora_id"] is None and stored["lora_name"] is None

        longer = a + [7, 7, 7, 7]  # its first two blocks are cached: only the third is new
        h3 = prefix_block_hashes(longer, BS)[2]
        bm.free_sequence(commit(bm, "b", longer))
        step()
        await publish()
        (stored,) = got[-1]
        assert stored["block_hashes"] == [h3] and stored["parent_block_hash"] == h2
        assert stored["token_ids"] == [7, 7, 7, 7]

        # another prompt evicts the chain from the pool; host memory takes it
        c = list(range(300, 312))
        commit(bm, "c", c)
        tier_events += [("host", True, h) for h in (h1, h2, h3)]
        step()
        await publish()
        kinds = {(e["type"], e["medium"]): e for e in got[-1]}
        assert set(kinds[("BlockRemoved", "GPU")]["block_hashes"]) == {h1, h2, h3}
        on_host = kinds[("BlockStored", "CPU")]  # one chain: one event, as vLLM sends it
        assert on_host["block_hashes"] == [h1, h2, h3] and on_host["parent_block_hash"] is None
        assert on_host["token_ids"] == longer
        assert kinds[("BlockStored", "GPU")]["block_hashes"] == prefix_block_hashes(c, BS)

        feed.clear("host")
        await publish()
        assert got[-1] == [{"type": "AllBlocksCleared"}]
        assert zpub.dropped == 0 and zpub.send_failed == 0
    finally:
        zpub.close()


async def connected(sub: Subscriber, fmt: str) -> ZmqKVEventPublisher:
    """A ZMQ publisher whose subscription is up (PUB drops what it sends before), drained."""
    zpub = ZmqKVEventPublisher(f"tcp://127.0.0.1:{sub.port}", TOPIC, fmt)
    for _ in range(100):
        zpub.put([{"type": "AllBlocksCleared"}])
        if sub.recv(50) is not None:
            break
    while sub.recv(100) is not None:
        pass
    return zpub


@pytest.mark.parametrize("fmt", ["map", "array"])
async def test_blocks_computed_under_an_adapter_name_it(sub, fmt):
    """vLLM's ``lora_name``: the same tokens under adapter "sql" and under the base model are
    two chains, and each BlockStored says whose it is, in the pool and after an eviction to
    host memory; with the name a consumer recomputes the first block's hash."""
    zpub = await connected(sub, fmt)
    try:
        bm = BlockManager(num_blocks=4, block_size=BS)
        tier_events: list[tuple[str, bool, int]] = []
        feed = KVEventFeed(
            ("device", "host"), lambda: [tier_events.pop(0) for _ in list(tier_events)]
        )
        seen: list = []
        pub = KVEventPublisher(
            NoBus(),  # type: ignore[arg-type]
            worker_id="p0",
            instance="i1",
            block_size=BS,
            drain=feed.drain_delta,
            snapshot=feed.snapshot,
            interval=1.0,
            tiers=feed.tiers,
            listeners=(zpub, seen.extend),
        )
        await pub.publish_now(snapshot=True)
        assert sub.recv() is not None  # the first batch: AllBlocksCleared

        tokens = list(range(100, 108))
        base = prefix_block_hashes(tokens, BS)
        sql = prefix_block_hashes(tokens, BS, extra_keys=identity_keys("sql"))
        assert set(base).isdisjoint(sql)
        bm.free_sequence(commit(bm, "a", tokens, lora="sql"))
        bm.free_sequence(commit(bm, "b", tokens))
        stored, removed = bm.drain_events()
        feed.push(stored, removed, bm.take_lineage(stored))
        await pub.publish_now()
        _, events, _ = vllm_batch(sub.recv()[1], fmt)  # type: ignore[index]
        by_chain = {tuple(e["block_hashes"]): e for e in events}
        assert by_chain[tuple(sql)]["lora_name"] == "sql"
        assert by_chain[tuple(base)]["lora_name"] is None
        assert all(e["lora_id"] is None for e in events)  # pdserve has names, not vLLM's ids
        first = by_chain[tuple(sql)]
        assert hash_block(ROOT_HASH, first["token_ids"][:BS], identity_keys("sql")) == sql[0]
        # on NATS: the name once, an index per block
        (msg,) = [m for m in seen if m.stored]
        assert msg.lora_names == ["sql"]
        assert dict(zip(msg.stored, msg.lora_index, strict=True)) == {
            **dict.fromkeys(sql, 1),
            **dict.fromkeys(base, 0),
        }

        # another prompt evicts both chains; host memory takes the adapter's and names it too
        commit(bm, "c", list(range(300, 316)))
        tier_events += [("host", True, h) for h in sql]
        stored, removed = bm.drain_events()
        feed.push(stored, removed, bm.take_lineage(stored))
        await pub.publish_now()
        _, events, _ = vllm_batch(sub.recv()[1], fmt)  # type: ignore[index]
        (on_host,) = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
        assert on_host["block_hashes"] == sql and on_host["lora_name"] == "sql"
    finally:
        zpub.close()


def test_the_queue_drops_the_oldest_and_counts():
    q = DropOldest(3)
    for i in range(5):
        q.put(i)
    assert q.dropped == 2 and q.take_all() == [2, 3, 4]
    assert q.take_all(wait=False) == []
    q.close()
    assert q.take_all() is None  # closed and empty: the sender thread ends


def test_publishing_never_waits_for_a_subscriber():
    """No subscriber at all (PUB discards), a tiny queue: the engine side's call returns at
    once, whatever the sender thread does."""
    zpub = ZmqKVEventPublisher("tcp://127.0.0.1:1", TOPIC, "map", max_queue=4)  # nobody there
    try:
        t0 = time.perf_counter()
        for _ in range(20_000):
            zpub.put([{"type": "AllBlocksCleared"}])
        assert time.perf_counter() - t0 < 2.0
        assert zpub.seq == 20_000
    finally:
        zpub.close()
    assert zpub.sent + zpub.dropped + zpub.send_failed == 20_000
