"""``--kv-events-zmq`` on a real prefill worker process (issue 33): over a real nats-server, a
prefill's blocks reach a real ZMQ subscriber as vLLM's BlockStored (chained hashes, parent,
tokens, medium "GPU"), after the worker's first batch, AllBlocksCleared; the same blocks reach
the gateway's registry on NATS with their lineage. A prefix-cache reset (``POST
/reset_prefix_cache``'s request) is refused while a lease holds the blocks, then clears them and
says so on both streams. Blocks computed under a LoRA adapter name it (vLLM's ``lora_name``)."""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import zmq

from pdserve.shared.bus.discovery_messages import KVEvents
from pdserve.shared.bus.lease_messages import ReleaseLease
from pdserve.shared.discovery.cache_reset import reset_all
from pdserve.shared.kv.layout import ROOT_HASH, identity_keys, prefix_block_hashes
from tests.integration.stack import start_nats, start_service, stop_all
from tests.integration.worker_client import connected

BS = 16
PROMPT = list(range(10, 10 + 3 * BS + 5))  # 3 full blocks and a partial one (demo vocab: 264)


def cleared_event(sub: zmq.Socket, timeout_ms: int = 20_000) -> dict | None:
    """The next AllBlocksCleared in the stream (None if none comes in time)."""
    while sub.poll(timeout_ms):
        _, _, payload = sub.recv_multipart()
        for event in msgpack.unpackb(payload, raw=False)[1]:
            if event["type"] == "AllBlocksCleared":
                return event
    return None


def events(sub: zmq.Socket, want: int, timeout_ms: int = 20_000) -> list[dict]:
    """Events (vLLM's map form) until ``want`` BlockStored hashes arrived."""
    out: list[dict] = []
    stored = 0
    while stored < want and sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        _, batch, rank = msgpack.unpackb(payload, raw=False)
        assert rank == 0
        out += batch
        stored += sum(len(e["block_hashes"]) for e in batch if e["type"] == "BlockStored")
    return out


@contextlib.asynccontextmanager
async def zmq_prefill_worker(tmp_path, worker_id: str, **options):
    """A real prefill worker (``options`` on top of this file's) publishing KV events to a ZMQ
    socket bound here and on NATS: yields the subscriber, a gateway-side client, and the
    KVEvents heard on NATS (a list that grows)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # the worker connects (no "*": vLLM's rule)
    nats = start_nats(tmp_path)
    opts = {
        "worker_id": worker_id,
        "block_size": BS,
        "num_kv_blocks": 32,
        "heartbeat_seconds": 0.2,
        "kv_events_zmq": f"tcp://127.0.0.1:{port}",
        "kv_events_zmq_topic": "kv",
        **options,
    }
    worker = start_service("prefill", nats.url, tmp_path, None, opts)
    try:
        async with connected(nats.url, [worker]) as gw:
            on_nats: list[KVEvents] = []

            async def heard(msg: KVEvents, headers) -> None:
                on_nats.append(msg)

            await gw.bus.subscribe(gw.bus.subjects.kv(worker_id), heard, (KVEvents,))
            await asyncio.sleep(1.0)  # the PUB side's connection (it drops before it is up)
            yield sub, gw, on_nats
    finally:
        stop_all([worker])
        nats.stop()
        sub.close(linger=0)
        ctx.term()


async def stored_deltas(on_nats: list[KVEvents], want: int) -> list[KVEvents]:
    """The deltas heard on NATS, once they store ``want`` blocks (or after ~5 s, as they are)."""
    deltas: list[KVEvents] = []
    for _ in range(50):
        deltas = [m for m in on_nats if m.stored and not m.snapshot]
        if sum(len(m.stored) for m in deltas) >= want:
            break
        await asyncio.sleep(0.1)
    return deltas


async def test_a_worker_publishes_vllm_kv_events_on_zmq(tmp_path):
    async with zmq_prefill_worker(tmp_path, "pz") as (sub, gw, on_nats):
        result = await gw.prefill("pz", "r1", PROMPT)
        assert result.error is None
        got = await asyncio.to_thread(events, sub, 3)
        chain = prefix_block_hashes(PROMPT, BS)
        stored = [e for e in got if e["type"] == "BlockStored"]
        assert [h for e in stored for h in e["block_hashes"]] == chain
        assert stored[0]["parent_block_hash"] is None and stored[0]["medium"] == "GPU"
        assert [t for e in stored for t in e["token_ids"]] == PROMPT[: 3 * BS]
        assert stored[0]["block_size"] == BS

        # the gateway's side on NATS: the same blocks, with their lineage
        deltas = await stored_deltas(on_nats, 3)
        assert [h for m in deltas for h in m.stored] == chain
        assert [p for m in deltas for p in m.parents] == [ROOT_HASH, *chain[:2]]
        assert [t for m in deltas for t in m.token_ids] == PROMPT[: 3 * BS]
        assert set(chain) <= gw.registry.cached_blocks("pz").hashes

        # POST /reset_prefix_cache's request: refused while the lease holds the blocks,
        # then done, announced as AllBlocksCleared on both streams
        heard_before = len(on_nats)
        busy = await reset_all(gw.bus, ["pz"], "reset-1", 5.0)
        assert busy["pz"].status == "busy"
        await gw.bus.publish(gw.bus.subjects.lease("pz"), ReleaseLease("r1"))
        for _ in range(50):
            done = (await reset_all(gw.bus, ["pz"], "reset-2", 5.0))["pz"]
            if done.status == "ok":
                break
            await asyncio.sleep(0.1)
        assert (done.status, done.blocks) == ("ok", 3)
        cleared = await asyncio.to_thread(cleared_event, sub)
        assert cleared == {"type": "AllBlocksCleared"}
        for _ in range(50):
            if any(m.cleared for m in on_nats[heard_before:]):
                break
            await asyncio.sleep(0.1)
        assert any(m.cleared for m in on_nats[heard_before:]), on_nats
        assert not gw.registry.cached_blocks("pz").hashes
        # and the cache starts over: the same prompt is computed, its blocks stored again
        again = await gw.prefill("pz", "r2", PROMPT)
        assert again.cached_tokens == 0


async def test_blocks_under_an_adapter_carry_its_name(tmp_path, llama_dir):
    """A prefill worker serving a PEFT adapter (``--lora-modules``): the prompt's blocks
    computed under it reach the ZMQ subscriber with vLLM's ``lora_name`` (the same prompt under
    the base model: another chain, ``lora_name`` None), and NATS's KVEvents name it too."""
    from tests.lora_support import build_adapter

    adapter = build_adapter(llama_dir, tmp_path / "sql", seed=5, rank=4)
    options = {"model": str(llama_dir), "lora_modules": [f"sql={adapter}"]}
    async with zmq_prefill_worker(tmp_path, "pl", **options) as (sub, gw, on_nats):
        assert (await gw.prefill("pl", "r1", PROMPT, lora="sql")).error is None
        assert (await gw.prefill("pl", "r2", PROMPT)).error is None
        got = await asyncio.to_thread(events, sub, 6)
        sql = prefix_block_hashes(PROMPT, BS, extra_keys=identity_keys("sql"))
        base = prefix_block_hashes(PROMPT, BS)
        name_of = {
            h: e["lora_name"] for e in got if e["type"] == "BlockStored" for h in e["block_hashes"]
        }
        assert name_of == {**dict.fromkeys(sql, "sql"), **dict.fromkeys(base, None)}
        deltas = await stored_deltas(on_nats, 6)
        on_bus = {
            h: [None, *m.lora_names][i]
            for m in deltas
            for h, i in zip(m.stored, m.lora_index or [0] * len(m.stored), strict=True)
        }
        assert on_bus == name_of
