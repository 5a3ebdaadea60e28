"""Tenants through a P/D stack (a prefill worker, a decode worker, a gateway with API keys and
``--scheduling-policy priority``): a prompt's cached blocks serve only its own key and
``cache_salt`` (the usage's cached_tokens), and a high-priority request sent behind a full
prefill queue of low-priority ones gets its first token before most of them."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import nats
import pytest

from pdserve.shared.bus.protocol import decode
from tests.integration.stack import free_port, log_text, start_nats, start_service, stop_all
from tests.integration.test_gateway_e2e import worker_loads

KEYS = ("key-a", "key-b")
WORKER_OPTIONS = {
    "dtype": "float32",
    "num_kv_blocks": 256,
    "block_size": 16,
    "heartbeat_seconds": 0.2,
    "scheduling_policy": "priority",
}
# the prefill worker computes one prompt at a time, in small chunks: its queue fills
PREFILL_OPTIONS = {**WORKER_OPTIONS, "max_num_seqs": 1, "max_num_batched_tokens": 32}
LOW = 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    logs = tmp_path_factory.mktemp("tenancy-logs")
    nats_server = start_nats(logs)
    model = str(llama_dir)
    port = free_port()
    children = [
        start_service(
            "prefill",
            nats_server.url,
            logs,
            options={**PREFILL_OPTIONS, "model": model, "worker_id": "p0"},
        ),
        start_service(
            "decode",
            nats_server.url,
            logs,
            options={**WORKER_OPTIONS, "model": model, "worker_id": "d0"},
        ),
        start_service(
            "gateway",
            nats_server.url,
            logs,
            options={
                "model": model,
                "port": port,
                "api_key": ",".join(KEYS),
                "scheduling_policy": "priority",
            },
        ),
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while set(worker_loads(base)) != {"p0", "d0"}:
            for child in children:
                assert child.alive(), f"{child.name} died:\n{log_text(child)}"
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.2)
        yield base, nats_server.url
    finally:
        for child in children:
            if not child.alive():
                print(f"{child.name} died:\n{log_text(child)}")
        stop_all(children)
        nats_server.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def model_name(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/v1/models", headers=auth(KEYS[0])) as r:
        return (await r.json())["data"][0]["id"]


async def test_cached_blocks_serve_only_their_own_key_and_salt(stack):
    base, _ = stack
    prompt = "Tenants must not learn each other's prompts from timing. " * 6
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)

        async def cached(key: str, **extra) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, **extra}
            async with session.post(base + "/v1/completions", json=body, headers=auth(key)) as r:
                payload = await r.json()
                assert r.status == 200, payload
                return payload["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached("key-a") == 0
        assert await cached("key-a") > 0  # the same key: its own blocks
        assert await cached("key-b") == 0  # another key: none of them (scope key)
        assert await cached("key-a", cache_salt="s1") == 0  # a salt: another chain
        assert await cached("key-a", cache_salt="s1") > 0
        assert await cached("key-b", cache_salt="s1") == 0  # the salt alone is not enough

        # chat too, and a bad salt is a 400 naming the field
        chat = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 2,
            "cache_salt": "s2",
        }
        for expected in ("zero", "some"):
            async with session.post(
                base + "/v1/chat/completions", json=chat, headers=auth("key-a")
            ) as r:
                got = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (got == 0) == (expected == "zero"), (expected, got)
        async with session.post(
            base + "/v1/completions",
            json={"model": model, "prompt": prompt, "cache_salt": ""},
            headers=auth("key-a"),
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "cache_salt"


async def test_a_high_priority_request_overtakes_a_full_queue(stack):
    base, nats_url = stack
    n_low = 8
    sent: list[str] = []
    nc = await nats.connect(nats_url)

    async def on_prefill(msg) -> None:
        sent.append(decode(msg.data).client_id)

    await nc.subscribe("pdserve.prefill.*", cb=on_prefill)
    await nc.flush()
    firsts: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)

        async def one(rid: str, priority: int) -> None:
            # distinct long prompts (no shared blocks): each is a whole prefill
            body = {
                "model": model,
                "prompt": f"{rid}: " + "a queue of work " * 25,
                "max_tokens": 2,
                "stream": True,
                "priority": priority,
            }
            headers = {**auth("key-a"), "x-request-id": rid}
            async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {") and rid not in firsts:
                        firsts[rid] = time.monotonic()

        lows = [asyncio.create_task(one(f"low-{i}", LOW)) for i in range(n_low)]
        deadline = time.monotonic() + 30
        while len(sent) < n_low:  # every low one is in the prefill worker's queue
            assert time.monotonic() < deadline, sent
            for task in lows:
                if task.done():
                    task.result()  # (raises what failed it)
            await asyncio.sleep(0.01)
        await one("high", -LOW)
        await asyncio.gather(*lows)
    await nc.close()
    order = sorted(firsts, key=firsts.__getitem__)
    # The worker was computing one or two low prompts when the high one came; it must come
    # before the rest (under fcfs it would be last).
    assert order.index("high") <= 2, order
