"""The gateway over real HTTP and a real nats-server.

Behind the gateway runs ``ScriptedDecodeWorker``: it speaks the real wire protocol on the real bus
(heartbeats, DecodeRequest in, TokenBatch out, Cancel) but generates a fixed token script instead
of running a model, so these tests pin down the gateway alone: validation, auth, SSE framing,
detokenization, stop strings, cancellation, errors, admission, metrics, and a fuzz run. Model
output against HF transformers is covered by the end-to-end tests with real workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from pdserve.gateway.app_state import GATEWAY_KEY, Gateway
from pdserve.gateway.inflight.legs import BUS_ID_SUFFIX
from pdserve.gateway.router import Router
from pdserve.gateway.server import create_app
from pdserve.gateway.tokenizer import ModelTokenizer
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
from pdserve.shared.discovery.announce import HeartbeatPublisher
from tests.integration.stack import free_port, log_text, start_nats, start_service
from tests.otlp_receiver import OtlpReceiver
from tests.unit.gateway_fixtures import train_byte_level, write_model_dir

MODEL = "tiny-gw"
CONTEXT = 128
SCRIPT_TEXT = "Hello world! Grüße 😀 日本語 END tail"
# Seconds without heartbeats before the gateway drops a worker: generous by default, since the
# scripted workers share the test's event loop on a shared machine; short where a test kills one.
WORKER_TIMEOUT = 10.0
DEATH_TIMEOUT = 3.0
FAIL_SEED = 666  # the scripted worker fails requests with this seed after two tokens
ABORT_SEED = 444  # ... ends them with finish_reason "abort" and no error text
DIE_SEED = 555  # ... dies (stops heartbeats and tokens) after two tokens
STALL_SEED = 556  # ... goes silent (no heartbeats, no tokens) for a while, answering pings
SLOW_SEED = 777  # ... and streams these slowly (for disconnects and admission)


def client_id(bus_id: str) -> str:
    """The client's x-request-id inside a request's bus id (the gateway adds a random tail)."""
    return bus_id[: -(BUS_ID_SUFFIX + 1)]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    nats = start_nats(tmp_path_factory.mktemp("nats"))
    yield nats.url
    nats.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(
        tmp_path_factory.mktemp("model") / MODEL,
        train_byte_level(vocab_size=300),
        max_position_embeddings=CONTEXT,
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


class ScriptedDecodeWorker:
    def __init__(
        self,
        nats_url: str,
        namespace: str,
        tokenizer: ModelTokenizer,
        worker_id="scripted-d0",
        refuse: bool = False,
        free_blocks: int = 100,
    ) -> None:
        self.bus = Bus(BusConfig(nats_url=nats_url, namespace=namespace), worker_id)
        self.worker_id = worker_id
        self.refuse = refuse  # answer every request with an "overloaded" refusal
        self.free_blocks = free_blocks
        self.block_size = 0  # unknown: the KV cache does not limit the context
        self.script = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        self.requests: list[DecodeRequest] = []
        self.headers: list[dict[str, str]] = []
        self.cancelled: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self.heartbeat = HeartbeatPublisher(self.bus, self.load, 0.2)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            worker_id=self.worker_id,
            role="decode",
            model=MODEL,
            free_blocks=self.free_blocks,
            total_blocks=max(100, self.free_blocks),
            running=len(self.tasks),
            waiting=0,
            block_size=self.block_size,
        )

    async def start(self) -> None:
        await self.bus.connect()
        await self.bus.subscribe(
            self.bus.subjects.decode(self.worker_id), self.on_decode, (DecodeRequest,)
        )
        await self.bus.subscribe(self.bus.subjects.cancel, self.on_cancel, (Cancel,))
        await self.heartbeat.start()

    async def stop(self) -> None:
        await self.heartbeat.stop()
        for task in list(self.tasks):
            task.cancel()
        await self.bus.close()

    async def on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        self.cancelled.update((msg.bus_id, client_id(msg.bus_id)))

    async def on_decode(self, msg: DecodeRequest, headers: dict[str, str]) -> None:
        self.requests.append(msg)
        self.headers.append(headers)
        task = asyncio.create_task(self.generate(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def generate(self, req: DecodeRequest) -> None:
        if self.refuse:
            item = TokenItem(req.bus_id, [], "error", "worker full", "overloaded")
            await self.bus.publish(req.reply_to, TokenBatch([item]))
            return
        delay = 0.05 if req.sampling.seed == SLOW_SEED else 0.002
        n = min(req.sampling.max_tokens, len(self.script))
        start = len(req.output_token_ids)  # after a prefill worker made the first token
        for i in range(start, n):
            await asyncio.sleep(delay)
            if req.bus_id in self.cancelled:
                return
            if req.sampling.seed == DIE_SEED and i == start + 2:
                await self.heartbeat.stop(gone=False)  # as if kill -9: no goodbye, no tokens
                return
            if req.sampling.seed == STALL_SEED and i == start + 2:
                # a busy worker whose event loop is starved: heartbeats stop past the registry
                # timeout, but the process (and its NATS subscriptions) is alive
                self.heartbeat._task.cancel()
                await asyncio.sleep(DEATH_TIMEOUT + 2.0)
                self.heartbeat._task = asyncio.create_task(self.heartbeat._loop())
            if req.sampling.seed == FAIL_SEED and i == 2:
                item = TokenItem(req.bus_id, [], "error", "injected failure", "internal")
            elif req.sampling.seed == ABORT_SEED and i == 2:  # an abort with no message
                item = TokenItem(req.bus_id, [self.script[i]], "abort", position=i)
            else:
                finish = "length" if i == n - 1 else None
                item = TokenItem(req.bus_id, [self.script[i]], finish, position=i)
            await self.bus.publish(req.reply_to, TokenBatch([item]))
            if item.finish_reason:
                return


class ScriptedPrefillWorker:
    """Answers PrefillRequests with the script's first token and a KV handle, or misbehaves:
    mode "overloaded" refuses, "crash" stops its heartbeat and never answers, "silent" keeps
    beating but never answers."""

    def __init__(self, nats_url, namespace, tokenizer, worker_id, mode="ok", waiting=0) -> None:
        self.bus = Bus(BusConfig(nats_url=nats_url, namespace=namespace), worker_id)
        self.worker_id = worker_id
        self.mode = mode
        self.waiting = waiting
        self.script = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        self.requests: list[PrefillRequest] = []
        self.released: list[str] = []
        self.heartbeat = HeartbeatPublisher(self.bus, self.load, 0.2)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            worker_id=self.worker_id,
            role="prefill",
            model=MODEL,
            free_blocks=100,
            total_blocks=100,
            running=0,
            waiting=self.waiting,
        )

    async def start(self) -> None:
        await self.bus.connect()
        subjects = self.bus.subjects
        await self.bus.subscribe(
            subjects.prefill(self.worker_id), self.on_prefill, (PrefillRequest,)
        )
        await self.bus.subscribe(subjects.lease(self.worker_id), self.on_release, (ReleaseLease,))
        await self.heartbeat.start()

    async def stop(self) -> None:
        await self.heartbeat.stop()
        await self.bus.close()

    async def on_release(self, msg: ReleaseLease, headers) -> None:
        self.released.append(client_id(msg.bus_id))

    async def on_prefill(self, req: PrefillRequest, headers) -> None:
        self.requests.append(req)
        if self.mode == "crash":
            await self.heartbeat.stop(gone=False)
            return
        if self.mode == "silent":
            return
        if self.mode == "overloaded":
            result = PrefillResult(
                req.bus_id, self.worker_id, None, None, None, "queue full", 0, "overloaded"
            )
        else:
            kv = KVHandle(
                worker_id=self.worker_id,
                ucx_address="ucx1:8000000000000001:AAAA",  # never dialled: decode is fake too
                block_ids=[0],
                num_tokens=len(req.prompt_token_ids),
                fingerprint={"model": MODEL},
                lease_expires=time.time() + 30,
            )
            finish = "length" if req.sampling.max_tokens == 1 else None
            result = PrefillResult(req.bus_id, self.worker_id, self.script[0], finish, kv, None, 3)
        await self.bus.publish(req.reply_to, result)


class Harness:
    def __init__(self, base: str, worker: ScriptedDecodeWorker | None, app: web.Application):
        self.base = base
        self.worker = worker
        self.extra: list = []
        self.app = app
        self.session = aiohttp.ClientSession()

    async def post(self, path: str, body, headers=None) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.base + path, data=data, headers=headers) as r:
            text = await r.text()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = {"raw": text}
            return r.status, payload, CIMultiDict(r.headers)

    async def stream(self, path: str, body, headers=None) -> tuple[int, list, dict]:
        async with self.session.post(self.base + path, json=body, headers=headers) as r:
            events = []
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
            return r.status, events, CIMultiDict(r.headers)

    def app_state(self) -> Gateway:
        return self.app[GATEWAY_KEY]

    async def get(self, path: str, headers=None) -> tuple[int, str]:
        async with self.session.get(self.base + path, headers=headers) as r:
            return r.status, await r.text()


async def start_harness(
    nats_url, model_dir, tokenizer, namespace, with_worker=True, extra=(), **gateway_options
) -> tuple[Harness, web.AppRunner]:
    """A gateway in this event loop; ``extra`` are (class, kwargs) of more scripted workers."""
    worker = None
    if with_worker:
        worker = ScriptedDecodeWorker(nats_url, namespace, tokenizer)
        await worker.start()
    extra_workers = [cls(nats_url, namespace, tokenizer, **kw) for cls, kw in extra]
    for w in extra_workers:
        await w.start()
    port = free_port()
    # The scripted workers share this event loop and the machine is shared: a heartbeat can be
    # late by a second under load, so the registry timeout is not made tighter than this.
    gateway_options.setdefault("worker_timeout", WORKER_TIMEOUT)
    config = GatewayConfig(host="127.0.0.1", port=port, **gateway_options)
    app = create_app(
        config,
        EngineConfig(model=str(model_dir)),
        BusConfig(nats_url=nats_url, namespace=namespace),
    )
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    harness = Harness(f"http://127.0.0.1:{port}", worker, app)
    harness.extra = extra_workers
    if with_worker or extra_workers:
        expected = int(with_worker) + len(extra_workers)
        deadline = time.monotonic() + 5
        while (await harness.get("/health"))[0] != 200 or len(
            harness.app_state().workers.loads()
        ) < expected:
            assert time.monotonic() < deadline, "gateway never saw the workers"
            await asyncio.sleep(0.05)
    return harness, runner


async def stop_harness(harness: Harness, runner: web.AppRunner) -> None:
    await harness.session.close()
    await runner.cleanup()
    for w in [harness.worker, *harness.extra]:
        if w is not None:
            await w.stop()


@contextlib.asynccontextmanager
async def running_harness(*args: Any, **kwargs: Any) -> AsyncIterator[Harness]:
    """``start_harness`` for the length of an ``async with`` block, stopped however it ends."""
    harness, runner = await start_harness(*args, **kwargs)
    try:
        yield harness
    finally:
        await stop_harness(harness, runner)


_namespace_counter = iter(range(10**6))


@pytest.fixture
async def gw(nats_url, model_dir, tokenizer):
    namespace = f"t{next(_namespace_counter)}"
    async with running_harness(
        nats_url, model_dir, tokenizer, namespace, max_body_bytes=64 * 1024
    ) as harness:
        yield harness


def assert_openai_error(payload: dict, param: str | None = None) -> None:
    assert set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
    if param is not None:
        assert payload["error"]["param"] == param, payload


# ----------------------------------------------------------------------------- bad input

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


async def test_bad_input_is_a_4xx_openai_error(gw: Harness):
    cases = [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"\xff\xfe\x00", 400, None),
        ("/v1/completions", b"[1,2,3]", 400, None),
        ("/v1/completions", b"[" * 20_000 + b"]" * 20_000, 400, None),
        ("/v1/completions", b'{"model": "tiny-gw", "prompt": "a\\ud83d"}', 400, None),
        ("/v1/completions", b'{"model": "\\udc00", "prompt": "a"}', 400, None),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 101}}, 400, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"300": 2}}, 400, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "temperature": 3}, 400, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "model": "nope"}, 404, "model"),
        ("/v1/completions", {**COMPLETION, "max_tokens": CONTEXT}, 400, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**6]}, 400, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": "x" * (CONTEXT * 8)}, 400, None),
        ("/v1/completions", {"prompt": "x"}, 400, "model"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "bot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "n"),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function"}]},
            400,
            "tools[0].function",
        ),
    ]
    for path, body, status, param in cases:
        code, payload, headers = await gw.post(path, body)
        assert code == status, (body if isinstance(body, dict) else body[:40], payload)
        assert_openai_error(payload, param)
        assert headers.get("x-request-id")
    # The temperature NaN case cannot be sent as JSON by json.dumps(allow_nan=False) clients.
    code, payload, _ = await gw.post(
        "/v1/completions", b'{"model": "tiny-gw", "prompt": "a", "temperature": NaN}'
    )
    assert code == 400
    assert_openai_error(payload)
    assert (await gw.get("/health"))[0] == 200


async def test_context_is_capped_by_the_decode_workers_kv_cache(gw: Harness):
    gw.worker.block_size = 1  # 100 blocks of 1 token: smaller than the model's 128
    capacity = 100
    await wait_for(lambda: gw.app_state().context_limit() == capacity, "the new heartbeat")
    prompt = [5, 6]
    code, payload, _ = await gw.post(
        "/v1/completions", {**COMPLETION, "prompt": prompt, "max_tokens": capacity - 1}
    )
    assert code == 400
    assert_openai_error(payload, "max_tokens")
    code, _, _ = await gw.post(
        "/v1/completions", {**COMPLETION, "prompt": prompt, "max_tokens": capacity - 2}
    )
    assert code == 200


async def test_request_that_does_not_fit_the_bus_is_a_400(gw: Harness):
    gw.app_state().bus.max_bytes = 300  # as if --max-message-bytes were tiny
    code, payload, _ = await gw.post("/v1/completions", {**COMPLETION, "prompt": list(range(100))})
    assert code == 400
    assert_openai_error(payload)
    assert gw.worker.requests == []


async def test_oversized_body_is_413_with_the_configured_limit(gw: Harness):
    small = {**COMPLETION, "user": "u" * 60_000}  # big body, short prompt
    assert (await gw.post("/v1/completions", small))[0] == 200
    code, payload, _ = await gw.post("/v1/completions", {**COMPLETION, "prompt": "a" * 70_000})
    assert code == 413
    assert_openai_error(payload)
    assert "65536" in payload["error"]["message"]


async def test_unknown_route_and_method_are_openai_errors(gw: Harness):
    code, payload, _ = await gw.post("/v1/embeddings", {"model": MODEL})
    assert code == 404
    assert_openai_error(payload)
    status, text = await gw.get("/v1/completions")
    assert status == 405
    assert_openai_error(json.loads(text))


async def test_request_id_is_honoured_and_validated(gw: Harness):
    code, payload, headers = await gw.post(
        "/v1/completions", COMPLETION, headers={"x-request-id": "my-req:1"}
    )
    assert code == 200 and headers["x-request-id"] == "my-req:1"
    assert payload["id"] == "cmpl-my-req:1"
    # On the bus the request has a unique id of its own; the client's names it on spans.
    sent = gw.worker.requests[-1]
    assert sent.client_id == "my-req:1"
    assert sent.bus_id.startswith("my-req:1-") and sent.bus_id != "my-req:1"
    code, payload, _ = await gw.post("/v1/completions", COMPLETION, headers={"x-request-id": "a b"})
    assert code == 400
    assert_openai_error(payload, "x-request-id")
    # Two at once under one x-request-id are still refused: it names one request on spans.
    slow = {**COMPLETION, "max_tokens": 10, "seed": SLOW_SEED}
    results = await asyncio.gather(
        *(gw.post("/v1/completions", slow, headers={"x-request-id": "twin"}) for _ in range(2))
    )
    assert sorted(r[0] for r in results) == [200, 409]
    assert_openai_error(next(r[1] for r in results if r[0] == 409), "x-request-id")


# ----------------------------------------------------------------------------- auth, docs


async def test_api_keys(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url,
        model_dir,
        tokenizer,
        "auth",
        api_key=["key-one", "key-two"],
        admin_api_key=["admin-key"],
    ) as harness:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}):
            code, payload, resp_headers = await harness.post("/v1/completions", COMPLETION, headers)
            assert code == 401
            assert_openai_error(payload)
            assert payload["error"]["type"] == "authentication_error"
        for key in ("key-one", "key-two"):
            code, _, _ = await harness.post(
                "/v1/completions", COMPLETION, {"Authorization": f"Bearer {key}"}
            )
            assert code == 200
        status, _ = await harness.get("/v1/models")
        assert status == 401
        assert (await harness.get("/health"))[0] == 200
        # every route that reads or changes state, not only /v1/ (gateway/access.py)
        user, admin = {"Authorization": "Bearer key-one"}, {"x-api-key": "admin-key"}
        assert (await harness.post("/tokenize", {"prompt": "Hi"}))[0] == 401
        assert (await harness.post("/tokenize", {"prompt": "Hi"}, user))[0] == 200
        assert (await harness.post("/reset_prefix_cache", b""))[0] == 401
        code, payload, _ = await harness.post("/reset_prefix_cache", b"", user)
        assert code == 403 and payload["error"]["code"] == "permission_denied"
        # the admin key reaches the workers over NATS (busy: the scripted worker never answers)
        assert (await harness.post("/reset_prefix_cache", b"", admin))[0] in (200, 409)


async def test_openapi_and_models(gw: Harness):
    status, text = await gw.get("/openapi.json")
    assert status == 200
    spec = json.loads(text)
    assert spec["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(
        spec["paths"]
    )
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["temperature"]["maximum"] == 2.0 and props["top_p"]["exclusiveMinimum"] == 0.0
    status, text = await gw.get("/v1/models")
    assert json.loads(text)["data"][0]["id"] == MODEL
    status, text = await gw.get(f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(text)["id"] == MODEL
    status, text = await gw.get("/v1/models/nope")
    assert status == 404
    assert_openai_error(json.loads(text), "model")


# ----------------------------------------------------------------------------- serving


async def test_streaming_completion(gw: Harness, tokenizer):
    body = {
        **COMPLETION,
        "max_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, events, headers = await gw.stream("/v1/completions", body, {"x-request-id": "s1"})
    assert status == 200 and headers["x-request-id"] == "s1"
    assert headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    # With include_usage, as OpenAI: the usage comes in one more chunk with no choices.
    *chunks, usage_chunk = events[:-1]
    script = gw.worker.script[:30]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == tokenizer.decode(script)
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == last["id"]
    assert usage_chunk["usage"] == {
        "prompt_tokens": len(tokenizer.encode("Hello")),
        "completion_tokens": len(script),
        "total_tokens": len(tokenizer.encode("Hello")) + len(script),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None for c in chunks)
    sent = gw.worker.requests[-1]
    assert sent.kv is None and sent.output_token_ids == []
    assert sent.prompt_token_ids == tokenizer.encode("Hello")
    assert sent.sampling.stop_token_ids == tokenizer.eos_token_ids


async def test_chat_streaming_and_not(gw: Harness, tokenizer):
    status, events, _ = await gw.stream("/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    expected = tokenizer.decode(gw.worker.script[:4])
    assert streamed == expected
    code, payload, _ = await gw.post("/v1/chat/completions", {**CHAT, "ignore_eos": True})
    assert code == 200
    assert payload["object"] == "chat.completion"
    assert payload["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert payload["usage"]["completion_tokens"] == 4
    # The templated prompt (BOS from the template, no extra one) went to the worker.
    prompt = gw.worker.requests[-1].prompt_token_ids
    assert tokenizer.decode(prompt, skip_special_tokens=False).startswith("<s><|user|>")
    assert gw.worker.requests[-1].sampling.ignore_eos
    assert gw.worker.requests[-1].sampling.stop_token_ids == []


async def test_stop_string_cuts_text_and_cancels(gw: Harness):
    body = {**COMPLETION, "max_tokens": 40, "stop": ["END"], "seed": SLOW_SEED}
    code, payload, _ = await gw.post("/v1/completions", body, {"x-request-id": "stop1"})
    assert code == 200
    choice = payload["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == SCRIPT_TEXT[: SCRIPT_TEXT.index("END")]
    await wait_for(lambda: "stop1" in gw.worker.cancelled, "cancel after a stop string")


async def test_disconnect_cancels_on_the_workers(gw: Harness):
    body = {**COMPLETION, "max_tokens": 40, "stream": True, "seed": SLOW_SEED}
    async with gw.session.post(
        gw.base + "/v1/completions", json=body, headers={"x-request-id": "gone1"}
    ) as r:
        assert r.status == 200
        await r.content.readline()  # the first event arrived: the stream is running
    await wait_for(lambda: "gone1" in gw.worker.cancelled, "cancel after a disconnect")
    await wait_for(lambda: gw.app_state().admitted_count == 0, "in-flight back to 0")


@pytest.mark.parametrize("seed", [FAIL_SEED, ABORT_SEED])
async def test_worker_error_is_an_error_event_or_5xx(gw: Harness, seed):
    body = {**COMPLETION, "max_tokens": 10, "seed": seed}
    status, events, _ = await gw.stream("/v1/completions", {**body, "stream": True})
    assert status == 200
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert_openai_error(events[-2])
    assert not any(c.get("choices", [{}])[0].get("finish_reason") for c in events[:-2])
    code, payload, _ = await gw.post("/v1/completions", body)
    assert code == 502
    assert_openai_error(payload)


async def test_no_decode_worker_is_503_with_retry_after(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url, model_dir, tokenizer, "empty", with_worker=False
    ) as harness:
        assert (await harness.get("/health"))[0] == 503
        code, payload, headers = await harness.post("/v1/completions", COMPLETION)
        assert code == 503 and int(headers["Retry-After"]) >= 1
        assert_openai_error(payload)


async def test_admission_limit_and_metrics(nats_url, model_dir, tokenizer):
    async with running_harness(nats_url, model_dir, tokenizer, "adm", max_queue=2) as harness:
        slow = {**COMPLETION, "max_tokens": 10, "seed": SLOW_SEED}
        results = await asyncio.gather(*(harness.post("/v1/completions", slow) for _ in range(5)))
        codes = sorted(r[0] for r in results)
        assert codes.count(200) >= 2 and set(codes) <= {200, 503}, codes
        assert 503 in codes
        status, text = await harness.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(text)}
        ok = codes.count(200)
        ttft = families["pdserve_time_to_first_token_seconds"]
        count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
        assert count == ok
        by_reason = {
            s.labels["finish_reason"]: s.value
            for s in families["pdserve_requests"].samples
            if s.name == "pdserve_requests_total"
        }
        assert by_reason == {"length": ok}
        used = families["pdserve_kv_cache_total_blocks"].samples
        assert [(s.labels["worker"], s.value) for s in used] == [("scripted-d0", 100.0)]
        gauge = families["pdserve_requests_in_flight"].samples[0].value
        assert gauge == 0


# ----------------------------------------------------------------------------- routing


def test_router_choices_and_burst_spreading():
    now = time.time()

    def load(wid, role, free=100, waiting=0, running=0, **kw):
        return WorkerLoad(
            wid, role, kw.pop("model", MODEL), free, 100, running, waiting, ts=now, **kw
        )

    workers = [
        load("p-busy", "prefill", waiting=3),
        load("p-idle", "prefill"),
        load("p-drain", "prefill", draining=True),
        load("p-other", "prefill", model="other-model"),
        load("d-full", "decode", free=10, local_prefill_threshold=4),
        load("d-roomy", "decode", free=60, local_prefill_threshold=8),
    ]

    def routable(role: str) -> list[WorkerLoad]:  # as the registry's: live, not draining
        return [w for w in workers if w.role == role and not w.draining]

    router = Router(routable, 16, model=MODEL)
    assert router.local_prefill_threshold() == 8
    # Nothing cached anywhere: least queued first; then, before any new heartbeat, what this
    # gateway sent counts too. (KV-aware choices: tests/unit/test_router.py.)
    short = list(range(10))
    assert [router.pick_prefill(short) for _ in range(3)] == ["p-idle"] * 3
    assert {router.pick_prefill(short) for _ in range(2)} == {"p-idle", "p-busy"}
    assert router.pick_prefill(short, exclude={"p-idle", "p-busy"}) is None
    # Most free blocks first; 30 blocks per request fill d-roomy down below d-full.
    assert [router.pick_decode(30 * 16) for _ in range(3)] == ["d-roomy", "d-roomy", "d-full"]
    workers[:] = [w for w in workers if w.worker_id != "d-roomy"]
    assert router.pick_decode(16) == "d-full"
    workers[:] = [w for w in workers if w.role != "decode"]
    assert router.pick_decode(16) is None and not router.has_decode()


# ----------------------------------------------------------------------------- lifecycle


async def test_prefill_first_then_decode_with_kv(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url,
        model_dir,
        tokenizer,
        "pd",
        extra=[(ScriptedPrefillWorker, {"worker_id": "p0"})],
    ) as harness:
        body = {
            **COMPLETION,
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, events, _ = await harness.stream("/v1/completions", body, {"x-request-id": "pd1"})
        assert status == 200 and events[-1] == "[DONE]"
        text = "".join(c["choices"][0]["text"] for c in events[:-2])
        script = harness.worker.script
        assert text == tokenizer.decode(script[:12])
        assert events[-2]["choices"] == []
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 12
        assert usage["prompt_tokens_details"] == {"cached_tokens": 3}
        (prefill_req,) = harness.extra[0].requests
        assert prefill_req.prompt_token_ids == tokenizer.encode("Hello")
        decode_req = harness.worker.requests[-1]
        assert decode_req.kv is not None and decode_req.kv.worker_id == "p0"
        assert decode_req.output_token_ids == [script[0]]
        # max_tokens=1 ends at the prefill worker; its lease is released at once.
        code, payload, _ = await harness.post(
            "/v1/completions", {**COMPLETION, "max_tokens": 1}, {"x-request-id": "pd2"}
        )
        assert code == 200 and payload["choices"][0]["finish_reason"] == "length"
        assert payload["choices"][0]["text"] == tokenizer.decode(script[:1])
        await wait_for(lambda: "pd2" in harness.extra[0].released, "lease release")
        assert len(harness.worker.requests) == 1


async def test_prefill_retried_on_another_worker(nats_url, model_dir, tokenizer):
    # The crashing and the refusing workers look least loaded, so they are tried first.
    async with running_harness(
        nats_url,
        model_dir,
        tokenizer,
        "retry",
        extra=[
            (ScriptedPrefillWorker, {"worker_id": "p-crash", "mode": "crash"}),
            (ScriptedPrefillWorker, {"worker_id": "p-busy", "mode": "overloaded", "waiting": 1}),
            (ScriptedPrefillWorker, {"worker_id": "p-ok", "waiting": 5}),
        ],
        worker_timeout=DEATH_TIMEOUT,
    ) as harness:
        started = time.monotonic()
        code, payload, _ = await harness.post("/v1/completions", {**COMPLETION, "max_tokens": 5})
        assert code == 200, payload
        assert payload["choices"][0]["text"] == tokenizer.decode(harness.worker.script[:5])
        assert [len(w.requests) for w in harness.extra] == [1, 1, 1]
        assert harness.worker.requests[-1].kv.worker_id == "p-ok"
        assert time.monotonic() - started < DEATH_TIMEOUT + 5


async def test_refusing_decode_worker_is_skipped(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url,
        model_dir,
        tokenizer,
        "refuse",
        extra=[
            (ScriptedPrefillWorker, {"worker_id": "p0"}),
            (ScriptedDecodeWorker, {"worker_id": "d-full", "refuse": True, "free_blocks": 999}),
        ],
    ) as harness:
        code, payload, _ = await harness.post("/v1/completions", {**COMPLETION, "max_tokens": 6})
        assert code == 200, payload
        assert payload["choices"][0]["text"] == tokenizer.decode(harness.worker.script[:6])
        refused = harness.extra[1].requests
        assert len(refused) == 1 and refused[0].kv is not None
        # The KV handle died with the refusal, so the next worker prefills locally.
        retried = harness.worker.requests[-1]
        assert retried.kv is None and retried.output_token_ids == [harness.worker.script[0]]


async def test_every_decode_worker_refusing_is_a_503(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url,
        model_dir,
        tokenizer,
        "allfull",
        with_worker=False,
        extra=[
            (ScriptedDecodeWorker, {"worker_id": "d-full", "refuse": True}),
            (ScriptedDecodeWorker, {"worker_id": "d-full2", "refuse": True}),
        ],
    ) as harness:
        code, payload, headers = await harness.post("/v1/completions", COMPLETION)
        assert code == 503 and int(headers["Retry-After"]) >= 1
        assert_openai_error(payload)
        assert [len(w.requests) for w in harness.extra] == [1, 1]


async def test_prefill_deadline_is_a_504(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url,
        model_dir,
        tokenizer,
        "slow",
        extra=[(ScriptedPrefillWorker, {"worker_id": "p-silent", "mode": "silent"})],
        prefill_timeout=0.5,
    ) as harness:
        code, payload, _ = await harness.post("/v1/completions", COMPLETION, {"x-request-id": "t1"})
        assert code == 504
        assert_openai_error(payload)
        await wait_for(lambda: "t1" in harness.worker.cancelled, "cancel after the deadline")


async def test_dead_decode_worker_ends_its_streams_with_an_error(nats_url, model_dir, tokenizer):
    async with running_harness(
        nats_url, model_dir, tokenizer, "death", worker_timeout=DEATH_TIMEOUT
    ) as harness:
        body = {**COMPLETION, "max_tokens": 20, "stream": True, "seed": DIE_SEED}
        started = time.monotonic()
        status, events, _ = await harness.stream("/v1/completions", body)
        assert status == 200 and events[-1] == "[DONE]"
        assert_openai_error(events[-2])
        assert "stopped" in events[-2]["error"]["message"]
        # Within the registry timeout, not --stall-timeout (60 s).
        assert time.monotonic() - started < DEATH_TIMEOUT + 5
        assert harness.app_state().admitted_count == 0


async def test_late_heartbeats_of_a_live_worker_do_not_fail_its_streams(
    nats_url, model_dir, tokenizer
):
    async with running_harness(
        nats_url, model_dir, tokenizer, "stall", worker_timeout=DEATH_TIMEOUT
    ) as harness:
        body = {**COMPLETION, "max_tokens": 8, "stream": True, "seed": STALL_SEED}
        started = time.monotonic()
        status, events, _ = await harness.stream("/v1/completions", body)
        assert time.monotonic() - started > DEATH_TIMEOUT  # it did go silent past the timeout
        assert status == 200 and events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1]), events
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert harness.app_state().workers.get("scripted-d0") is not None


async def test_nats_restart_recovers(tmp_path, model_dir, tokenizer):
    nats = start_nats(tmp_path)
    async with running_harness(nats.url, model_dir, tokenizer, "restart") as harness:
        assert (await harness.post("/v1/completions", COMPLETION))[0] == 200
        await asyncio.to_thread(nats.stop)
        await wait_until_status(harness, "/health", 503, "health to drop with NATS")
        await asyncio.to_thread(nats.start)
        started = time.monotonic()
        await wait_until_status(harness, "/health", 200, "health after the restart", 10)
        code, payload, _ = await harness.post("/v1/completions", COMPLETION)
        assert code == 200, payload
        assert time.monotonic() - started < 10
        nats.stop()


async def wait_until_status(harness, path, status, what, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while (await harness.get(path))[0] != status:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- the command


async def test_pdserve_gateway_command_traces_and_stops(nats_url, model_dir, tokenizer, tmp_path):
    """`pdserve gateway` as its own process: root and route spans reach an OTLP receiver, the
    trace context rides to the worker in NATS headers, and SIGTERM stops it cleanly."""
    worker = ScriptedDecodeWorker(nats_url, "cli", tokenizer)
    await worker.start()
    port = free_port()
    async with OtlpReceiver() as rx:
        child = start_service(
            "gateway",
            nats_url,
            tmp_path,
            env=rx.env(),
            options={"namespace": "cli", "model": model_dir, "port": port},
        )
        session = aiohttp.ClientSession()
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                assert child.alive(), log_text(child)
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(base + "/health") as r:
                        if r.status == 200:
                            break
                assert time.monotonic() < deadline, log_text(child)
                await asyncio.sleep(0.1)
            async with session.post(
                base + "/v1/completions", json=COMPLETION, headers={"x-request-id": "trace-1"}
            ) as r:
                assert r.status == 200 and r.headers["x-request-id"] == "trace-1"

            spans = await rx.wait_for(
                lambda spans: {"POST /v1/completions", "route"} <= {s.name for s in spans}
            )
            by_name = {
                s.name: s for s in spans if s.attributes.get("pdserve.request_id") == "trace-1"
            }
            root, route = by_name["POST /v1/completions"], by_name["route"]
            assert root.parent_span_id is None and root.kind == 2
            assert root.resource["service.name"] == "pdserve-gateway"
            assert route.parent_span_id == root.span_id and route.trace_id == root.trace_id
            attrs = root.attributes
            assert attrs["gen_ai.operation.name"] == "text_completion"
            assert attrs["gen_ai.request.model"] == MODEL
            assert attrs["gen_ai.usage.input_tokens"] == len(tokenizer.encode("Hello"))
            assert attrs["gen_ai.usage.output_tokens"] == 4
            assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
            assert "gen_ai.latency.time_to_first_token" in attrs
            # The worker's spans will hang under the root: its traceparent names root's span.
            traceparent = worker.headers[-1]["traceparent"]
            assert traceparent.split("-")[1:3] == [root.trace_id, root.span_id]

            # SIGTERM with a stream in flight: the stream still completes, then the process exits.
            slow = {**COMPLETION, "max_tokens": 20, "seed": SLOW_SEED, "stream": True}
            async with session.post(base + "/v1/completions", json=slow) as r:
                assert r.status == 200
                await r.content.readline()
                child.signal(signal.SIGTERM)
                rest = (await r.content.read()).decode()
            assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("[DONE]")
            assert await asyncio.to_thread(child.wait, 15) == 0, log_text(child)
        finally:
            await session.close()
            child.stop()
            await worker.stop()


# ----------------------------------------------------------------------------- fuzz

# Any code point, lone surrogates included (json.dumps sends them as \udXXX escapes).
any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=20)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | any_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "n",
        "stream",
        "stream_options",
        "user",
        "logprobs",
        "echo",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
    ]
)
plausible = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "other", ""])},
    optional={
        "prompt": st.one_of(
            st.text(max_size=30), any_text, st.lists(st.integers(-5, 400), max_size=6)
        ),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "x"])},
                optional={"content": st.one_of(st.text(max_size=20), json_values)},
            ),
            max_size=3,
        ),
        "max_tokens": st.one_of(st.integers(-2, 200), json_values),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "top_p": st.floats(-0.5, 1.5),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
        "stream": st.booleans(),
    },
)
bodies = st.one_of(
    plausible,
    st.dictionaries(field_names, json_values, max_size=6),
    json_values,
    st.binary(max_size=40),
)
# Valid requests with random optional parameters, so the fuzz also drives real generations.
valid_options = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**31),
    "stop": st.one_of(
        st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)
    ),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),  # a 400 unless stream is true
    "ignore_eos": st.booleans(),
    # accepted at their neutral values (gateway/sampling_fields.py)
    "user": st.text(max_size=8),
    "frequency_penalty": st.sampled_from([0, 0.0]),
    "presence_penalty": st.sampled_from([0, 0.0]),
    "logit_bias": st.just({}),
}
chat_only_options = {
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "store": st.booleans(),
    "service_tier": st.sampled_from(["auto", "default", "flex"]),
    "parallel_tool_calls": st.booleans(),
}
valid_completion = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=30), st.lists(st.integers(0, 299), min_size=1, max_size=6)
        ),
        "max_tokens": st.integers(1, 8),
    },
    optional=valid_options,
)
valid_chat = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant"]),
                    "content": st.text(max_size=20),
                }
            ),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(1, 8),
    },
    optional={**valid_options, **chat_only_options},
)
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), valid_completion),
    st.tuples(st.just("/v1/chat/completions"), valid_chat),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), bodies),
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=requests)
async def test_fuzz_never_5xx(gw: Harness, case):
    path, body = case
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep the run short
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with gw.session.post(gw.base + path, data=data) as r:
        payload = await r.read()
        event(f"HTTP {r.status}")
        assert r.status < 500, (r.status, payload[:300])
        if r.status >= 400:
            assert_openai_error(json.loads(payload))
    status, _ = await gw.get("/health")
    assert status == 200


# ----------------------------------------------------------------------------- helpers


async def wait_for(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
