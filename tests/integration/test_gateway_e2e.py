"""End to end over HTTP: `pdserve gateway`, two prefill and two decode workers, real NATS, real
UCX on loopback. HF transformers (float64) on the same tiny checkpoint is the oracle for every
greedy token; the official ``openai`` client is one of the HTTP clients.

A spy on the bus records which worker subjects each request crossed, so the tests can tell the
disaggregated path (prefill worker, then decode worker with a KV handle) from the local-prefill
path (short prompt straight to a decode worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections import Counter

import aiohttp
import nats
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedTokenizerFast

from pdserve.shared.bus.protocol import decode
from pdserve.shared.bus.request_messages import DecodeRequest, PrefillRequest
from tests.integration.stack import free_port, log_text, start_nats, start_service, stop_all
from tests.oracle import hf_greedy

LOCAL_PREFILL_THRESHOLD = 6  # prompts shorter than this skip the prefill workers
MAX_TOKENS = 8
WORKER_OPTIONS = {
    "dtype": "float64",  # greedy ties cannot flip between engine and oracle
    "num_kv_blocks": 96,
    "block_size": 16,
    "max_num_batched_tokens": 512,
    "heartbeat_seconds": 0.2,
    "local_prefill_threshold": LOCAL_PREFILL_THRESHOLD,
}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "naïve café déjà vu — 日本語のテキスト 🚀",
    "def add(a, b):\n    return a + b\n",
    "Hi",  # short: prefilled locally by a decode worker
]
WORKERS = ("p0", "p1", "d0", "d1")


@pytest.fixture(scope="module")
def hf_tokenizer(llama_dir):
    return PreTrainedTokenizerFast.from_pretrained(str(llama_dir))


@contextlib.contextmanager
def serving(logs, llama_dir, prefill: tuple[str, ...], decode: tuple[str, ...], options: dict):
    """NATS, the named prefill and decode workers and a gateway, up and registered; yields
    (base URL, NATS URL, children by name)."""
    nats_server = start_nats(logs)
    opts = {**options, "model": str(llama_dir)}
    port = free_port()
    children = [
        start_service("prefill", nats_server.url, logs, options={**opts, "worker_id": w})
        for w in prefill
    ] + [
        start_service("decode", nats_server.url, logs, options={**opts, "worker_id": w})
        for w in decode
    ]
    children.append(
        start_service(
            "gateway",
            nats_server.url,
            logs,
            options={"model": str(llama_dir), "port": port, "worker_timeout": 3.0},
        )
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while set(worker_loads(base)) != set(prefill + decode):
            for child in children:
                assert child.alive(), f"{child.name} died:\n{log_text(child)}"
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.2)
        yield base, nats_server.url, {c.name: c for c in children}
    finally:
        for child in children:
            if not child.alive():
                print(f"{child.name} died:\n{log_text(child)}")
        stop_all(children)
        nats_server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    logs = tmp_path_factory.mktemp("e2e-logs")
    with serving(logs, llama_dir, ("p0", "p1"), ("d0", "d1"), WORKER_OPTIONS) as running:
        yield running


def worker_loads(base: str) -> dict[str, float]:
    """Worker -> KV blocks in use, from the gateway's /metrics (empty while it is down)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_kv_cache_used_blocks":
            out = {s.labels["worker"]: s.value for s in family.samples}
    return out


async def wait_all_blocks_free(base: str, timeout: float = 10.0, workers=WORKERS) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = await asyncio.to_thread(worker_loads, base)
        if set(loads) == set(workers) and not any(loads.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still in use: {loads}"
        await asyncio.sleep(0.1)


class BusSpy:
    """Records the client request ids sent to each worker subject (a plain NATS wildcard
    listener)."""

    def __init__(self) -> None:
        self.prefill: dict[str, str] = {}  # request id -> prefill worker
        self.decode: dict[str, tuple[str, bool]] = {}  # request id -> (worker, had a KV handle)
        self.nc = None

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url)

        async def on_msg(msg) -> None:
            worker = msg.subject.rsplit(".", 1)[1]
            body = decode(msg.data)
            # the client's x-request-id (the bus id is the gateway's own, unique one)
            rid = body.client_id or body.bus_id
            if isinstance(body, PrefillRequest):
                self.prefill[rid] = worker
            elif isinstance(body, DecodeRequest):
                self.decode[rid] = (worker, body.kv is not None)

        await self.nc.subscribe("pdserve.prefill.*", cb=on_msg)
        await self.nc.subscribe("pdserve.decode.*", cb=on_msg)
        await self.nc.flush()

    async def close(self) -> None:
        await self.nc.close()


@pytest.fixture
async def spy(stack):
    s = BusSpy()
    await s.start(stack[1])
    yield s
    await s.close()


def expected_text(llama_dir, hf_tokenizer, prompt_ids: list[list[int]]) -> list[str]:
    outs = hf_greedy(llama_dir, prompt_ids, MAX_TOKENS)
    return [hf_tokenizer.decode(o, skip_special_tokens=True) for o in outs]


async def test_streaming_greedy_matches_hf_across_paths(stack, spy, llama_dir, hf_tokenizer):
    base, _, _ = stack
    prompt_ids = [hf_tokenizer.encode(p) for p in PROMPTS]
    assert len(prompt_ids[-1]) < LOCAL_PREFILL_THRESHOLD <= min(map(len, prompt_ids[:-1]))
    expected = expected_text(llama_dir, hf_tokenizer, prompt_ids)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def one(i: int, prompt: str) -> tuple[str, object, str]:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": f"e2e-{i}"},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, usage, finish

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    await client.close()
    for i, (text, usage, finish) in enumerate(results):
        assert text == expected[i], (PROMPTS[i], text, expected[i])
        assert finish == "length"
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == len(prompt_ids[i])
    # Long prompts went prefill worker -> decode worker with a KV handle, over both of each.
    long_ids = [f"e2e-{i}" for i in range(len(PROMPTS) - 1)]
    all_ids = [f"e2e-{i}" for i in range(len(PROMPTS))]
    await until(lambda: all(r in spy.decode for r in all_ids), "the spy saw every request")
    assert {spy.prefill[r] for r in long_ids} == {"p0", "p1"}
    assert all(spy.decode[r][1] for r in long_ids)
    assert {spy.decode[r][0] for r in long_ids} == {"d0", "d1"}
    # The short one was prefilled by a decode worker itself.
    short = f"e2e-{len(PROMPTS) - 1}"
    assert short not in spy.prefill and spy.decode[short][1] is False
    await wait_all_blocks_free(base)


async def test_chat_non_streaming_matches_hf(stack, llama_dir, hf_tokenizer):
    base, _, _ = stack
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    (expected,) = expected_text(llama_dir, hf_tokenizer, [list(ids)])
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    reply = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    await client.close()
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids)


async def test_repeated_prefix_goes_to_its_cache_and_matches_hf(
    stack, spy, llama_dir, hf_tokenizer
):
    """Turns sharing a long prefix land on the prefill worker whose cache holds it (the KV-aware
    router), reuse every full block of it, and still generate exactly what HF does."""
    base, _, _ = stack
    system = "You are a careful assistant. Paged attention stores keys and values in blocks. " * 4
    prompts = [system + f"Question number {turn}?" for turn in range(3)]
    prompt_ids = [hf_tokenizer.encode(p) for p in prompts]
    common = next(i for i, (a, b) in enumerate(zip(*prompt_ids[:2], strict=False)) if a != b)
    block = WORKER_OPTIONS["block_size"]
    assert common >= 8 * block  # a long shared prefix
    expected = expected_text(llama_dir, hf_tokenizer, prompt_ids)
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)
        cached, workers, texts = [], [], []
        for turn, prompt in enumerate(prompts):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            rid = f"prefix-{turn}"
            async with session.post(
                base + "/v1/completions", json=body, headers={"x-request-id": rid}
            ) as r:
                payload = await r.json()
            texts.append(payload["choices"][0]["text"])
            cached.append(payload["usage"]["prompt_tokens_details"]["cached_tokens"])
            await until(lambda rid=rid: rid in spy.prefill, "the prefill request")
            workers.append(spy.prefill[rid])
    assert texts == expected
    # One home worker for the shared prefix, and its cache serves the later turns: every full
    # block of the shared prefix, nothing of the differing tail.
    assert len(set(workers)) == 1, workers
    assert cached == [0] + [common // block * block] * 2, (cached, common)


async def test_reset_prefix_cache_forgets_every_workers_blocks(stack):
    """``POST /reset_prefix_cache`` (as vLLM's): every worker forgets its cached blocks, so a
    prompt served from the cache a moment ago is computed again."""
    base, _, _ = stack
    await wait_all_blocks_free(base)  # (a worker still holding a block would say "busy")
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)
        body = {"model": model, "prompt": "Reset the cache. " * 12, "max_tokens": 2}

        async def cached() -> int:
            async with session.post(base + "/v1/completions", json=body) as r:
                return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

        await cached()
        assert await cached() > 0
        await wait_all_blocks_free(base)
        async with session.post(base + "/reset_prefix_cache") as r:
            answer = await r.json()
            assert r.status == 200, answer
        assert set(answer["workers"]) == set(WORKERS)
        assert all(w["status"] == "ok" for w in answer["workers"].values())
        assert sum(w["blocks"] for w in answer["workers"].values()) > 0
        assert await cached() == 0


async def test_32_concurrent_streams_then_no_blocks_in_use(stack):
    base, _, _ = stack
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> tuple[str | None, bool]:
            body = {
                "model": await model_name(session, base),
                "prompt": f"Request number {i} asks about paged attention blocks",
                "max_tokens": MAX_TOKENS,
                "temperature": 0.8,
                "seed": i,
                "ignore_eos": True,
                "stream": True,
            }
            finish, done = None, False
            async with session.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    line = line.decode().strip()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        finish = event["choices"][0]["finish_reason"] or finish
            return finish, done

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 120)
    assert results == [("length", True)] * 32
    await wait_all_blocks_free(base)


@pytest.mark.parametrize("path", ["pulled", "local"])
async def test_decode_bursts_split_evenly(stack, spy, path):
    """Bursts of 8, 16 and 32 concurrent streams split within one of even between the two
    decode workers, whether they pull the KV (long prompts) or prefill it themselves (short
    ones): load reports lag a heartbeat, so the gateway counts what it has in flight."""
    base, _, _ = stack
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)

        async def one(rid: str, prompt: str) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": 24, "ignore_eos": True}
            body["stream"] = True
            async with session.post(
                base + "/v1/completions", json=body, headers={"x-request-id": rid}
            ) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content:
                    pass

        for burst in (8, 16, 32):
            rids = [f"{path}-{burst}-{i}" for i in range(burst)]
            prompts = [
                f"Burst {burst}, stream {i}: paged attention blocks" if path == "pulled" else "Hi"
                for i in range(burst)
            ]
            await asyncio.wait_for(asyncio.gather(*map(one, rids, prompts)), 120)
            await until(lambda rids=rids: all(r in spy.decode for r in rids), "every decode")
            where = Counter(spy.decode[r][0] for r in rids)
            assert {spy.decode[r][1] for r in rids} == {path == "pulled"}
            assert abs(where["d0"] - where["d1"]) <= 1, (burst, where)
    await wait_all_blocks_free(base)


async def test_disconnect_and_stop_string_free_every_block(stack, spy, llama_dir, hf_tokenizer):
    base, _, _ = stack
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)
        body = {
            "model": model,
            "prompt": PROMPTS[0],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        async with session.post(
            base + "/v1/completions", json=body, headers={"x-request-id": "leaver"}
        ) as r:
            assert r.status == 200
            await r.content.readline()  # generating on the workers now; then hang up
        await until(lambda: "leaver" in spy.decode or "leaver" in spy.prefill, "the spy saw it")

        # A stop string taken from the oracle's own output cuts the text right before it.
        ids = hf_tokenizer.encode(PROMPTS[1])
        (full,) = expected_text(llama_dir, hf_tokenizer, [ids])
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        body = {
            "model": model,
            "prompt": PROMPTS[1],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
        }
        async with session.post(base + "/v1/completions", json=body) as r:
            payload = await r.json()
        choice = payload["choices"][0]
        assert choice["text"] == full[: full.index(stop)]
        assert choice["finish_reason"] == "stop"
    await wait_all_blocks_free(base)


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def model_name(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def read_stream(response: aiohttp.ClientResponse, first: asyncio.Event) -> dict:
    """Collect one SSE stream: its text, finish reason, error event and [DONE]."""
    out = {"text": "", "finish": None, "error": None, "done": False}
    async for line in response.content:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        first.set()
        if line == "data: [DONE]":
            out["done"] = True
            continue
        event = json.loads(line[6:])
        if "error" in event:
            out["error"] = event["error"]
            continue
        out["text"] += event["choices"][0]["text"]
        out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
    return out


async def test_zz_killed_workers(stack, spy):
    """kill -9 of a decode worker mid-stream: its streams migrate to the other one and finish
    (issue 19; exactness is tests/integration/test_migration.py's), /health stays 200, and new
    requests (and prefills, after a prefill worker is killed too) go to the survivors. Runs
    last: it leaves the stack at 1P1D."""
    base, _, children = stack
    async with aiohttp.ClientSession() as session:
        model = await model_name(session, base)
        body = {"model": model, "max_tokens": 440, "ignore_eos": True, "stream": True}
        responses, firsts = [], []
        for i in range(4):
            r = await session.post(
                base + "/v1/completions",
                json={**body, "prompt": f"{PROMPTS[0]} {i}"},
                headers={"x-request-id": f"kill-{i}"},
            )
            assert r.status == 200
            responses.append(r)
        firsts = [asyncio.Event() for _ in responses]
        readers = [
            asyncio.create_task(read_stream(r, e)) for r, e in zip(responses, firsts, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 30)
        # The first token may come from a prefill worker before the DecodeRequest is sent.
        await until(lambda: all(f"kill-{i}" in spy.decode for i in range(4)), "decode requests")
        on_d1 = {f"kill-{i}" for i in range(4) if spy.decode[f"kill-{i}"][0] == "d1"}
        assert 0 < len(on_d1) < 4, spy.decode
        children["d1"].signal(signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*readers), 60)
        for r in responses:
            r.release()
        for result in results:
            assert result["done"] and result["error"] is None, result
            assert result["finish"] == "length", result
        # Streams on the dead worker moved within the registry timeout, not the request deadline.
        assert time.monotonic() - killed_at < 30
        assert {spy.decode[r][0] for r in on_d1} == {"d0"}

        async with session.get(base + "/health") as r:
            assert r.status == 200
        children["p1"].signal(signal.SIGKILL)
        for i in range(4):
            small = {"model": model, "prompt": PROMPTS[i], "max_tokens": 4, "ignore_eos": True}
            async with session.post(
                base + "/v1/completions", json=small, headers={"x-request-id": f"after-{i}"}
            ) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["finish_reason"] == "length"
            await until(lambda i=i: f"after-{i}" in spy.decode, "decode request")
            assert spy.decode[f"after-{i}"][0] == "d0"
    await wait_all_blocks_free(base, timeout=15, workers=("p0", "d0"))
