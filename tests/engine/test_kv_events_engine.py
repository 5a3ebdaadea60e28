"""A real engine's KV event stream with offload tiers (issue 33): every stored block comes with
its lineage - the parent hash and tokens that hash to it, in the pool and again in host memory
after an eviction -; a real ZMQ subscriber reads the run's events in vLLM's format; and the
worker's measured tier load costs (WorkerLoad.kv_host_load_cost) get filled once a host-memory
hit was loaded."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import zmq

from pdserve.shared.bus.discovery_messages import KVEvents
from pdserve.shared.discovery.kv_publisher import KVEventPublisher
from pdserve.shared.discovery.vllm_kv_events import ZmqKVEventPublisher
from pdserve.shared.kv.layout import ROOT_HASH, hash_block, prefix_block_hashes
from tests.engine.test_kv_offload import FILLERS, GREEDY, POOL, PROMPTS, ram_blocks
from tests.engine_support import make_engine

BS = 16


class NoBus:
    subjects = SimpleNamespace(kv=lambda worker: f"pdserve.kv.{worker}")

    async def publish(self, subject: str, msg) -> None:
        pass


def lineage(msgs: list[KVEvents], tier: str) -> dict[int, tuple[int, list[int]]]:
    """The stored blocks' (parent, tokens) of ``tier``'s deltas, each checked: its parent
    and tokens hash to it."""
    out = {}
    for m in msgs:
        if m.tier != tier or m.snapshot or not m.stored:
            continue
        assert len(m.parents) == len(m.stored)  # nothing unknown in a fresh engine
        for i, h in enumerate(m.stored):
            tokens = m.token_ids[i * BS : (i + 1) * BS]
            assert hash_block(m.parents[i], tokens) == h
            out[h] = (m.parents[i], tokens)
    return out


async def test_engine_events_lineage_zmq_and_load_costs(llama_dir):
    probe = make_engine(llama_dir, num_kv_blocks=4)
    engine = make_engine(llama_dir, num_kv_blocks=POOL, kv_offload_ram_gib=ram_blocks(probe, 64))
    feed = engine.kv_event_feed()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    zpub = ZmqKVEventPublisher(f"tcp://127.0.0.1:{port}")
    seen: list[KVEvents] = []
    pub = KVEventPublisher(
        NoBus(),
        "p0",
        "i1",
        BS,
        feed.drain_delta,
        feed.snapshot,
        1.0,  # type: ignore[arg-type]
        tiers=feed.tiers,
        listeners=(zpub, seen.extend),
    )
    try:
        for _ in range(100):  # until the PUB side's connection is up (it drops before)
            zpub.put([])
            if sub.poll(50):
                break
        while sub.poll(100):
            sub.recv_multipart()

        prompt = PROMPTS[0]
        engine.generate([prompt], GREEDY)
        await pub.publish_now()
        chain = prefix_block_hashes(prompt, BS)
        device = lineage(seen, "device")
        assert device[chain[0]] == (ROOT_HASH, prompt[:BS])
        assert device[chain[1]] == (chain[0], prompt[BS : 2 * BS])

        engine.generate(FILLERS[:6], GREEDY)  # evicts the prompt's blocks to host memory
        await pub.publish_now()
        assert lineage(seen, "host")[chain[1]] == (chain[0], prompt[BS : 2 * BS])
        host_stored = {}
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            _, events, _ = msgpack.unpackb(payload, raw=False)
            for e in events:
                if e["type"] == "BlockStored" and e["medium"] == "CPU":
                    for i, h in enumerate(e["block_hashes"]):
                        host_stored[h] = e["token_ids"][i * BS : (i + 1) * BS]
            if chain[0] in host_stored:
                break
        assert host_stored[chain[0]] == prompt[:BS]  # evicted with its tokens

        assert engine.offload.load_fields()["kv_host_load_cost"] == 0.0  # nothing loaded yet
        engine.generate([prompt], GREEDY)  # a host-memory hit, loaded into the pool
        assert engine.offload.stats().host_hits > 0
        fields = engine.offload.load_fields()
        assert 0.0 < fields["kv_host_load_cost"] < 10.0  # measured: a fraction of computing
        assert fields["kv_disk_load_cost"] == 0.0  # no disk tier
    finally:
        zpub.close()
        sub.close(linger=0)
        ctx.term()
        engine.close()
