"""The response models of ``gateway/response_models.py`` against what the gateway really sends.

A real gateway (``create_app``, over HTTP) and a real decode worker with a tiny llama engine
share one in-memory bus: every response below is built by the gateway's own code from real
tokens and log-probs. Each is validated with the pydantic models, which refuse unknown fields,
so a field added or renamed without its model fails here, and with the published
``/openapi.json``, so the document and the models cannot drift apart either.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, ValidationError

from pdserve.gateway import app_state as gateway_state
from pdserve.gateway.app_state import GATEWAY_KEY
from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.response_models import (
    RESPONSE_MODELS,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ErrorBody,
    ModelCard,
    ModelList,
    RunningUsage,
    Usage,
)
from pdserve.gateway.server import create_app
from pdserve.services.decode.worker import DecodeWorker
from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
from tests.bus_memory import MemoryBus, MemoryNetwork

NS = "t"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
LONG = 300  # tokens a stream asks for when a test fails it midway


# ----------------------------------------------------------------------------- the stack


@pytest.fixture(scope="module")
def engine_config(llama_dir) -> EngineConfig:
    return EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=96)


@pytest.fixture(scope="module")
def engine(engine_config) -> LLMEngine:
    return LLMEngine(engine_config)


async def _no_ucx() -> None:
    pass  # the worker prefills locally: no KV is pulled, so no UCX client is needed


class Stack:
    def __init__(self, client: TestClient, worker: DecodeWorker) -> None:
        self.client = client
        self.worker = worker
        self.model = client.server.app[GATEWAY_KEY].model.name

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        response = await self.client.post(path, json={"model": self.model, **body})
        return response.status, await response.json()

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """The data of each server-sent event, parsed, up to and without ``[DONE]``."""
        body = {"model": self.model, "stream": True, **body}
        async with self.client.post(path, json=body) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                text = line.decode("utf-8").strip()
                if not text.startswith("data: "):
                    continue
                if text == "data: [DONE]":
                    return
                yield json.loads(text[len("data: ") :])
        raise AssertionError("the stream ended without [DONE]")

    async def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        return [event async for event in self.events(path, body)]


@pytest.fixture
async def stack(engine, monkeypatch) -> AsyncIterator[Stack]:
    net = MemoryNetwork()
    monkeypatch.setattr(
        gateway_state, "Bus", lambda config, name: MemoryBus(config, name, network=net)
    )
    app = create_app(
        GatewayConfig(worker_timeout=30.0),
        EngineConfig(model=engine.config.model),
        BusConfig(namespace=NS),
    )
    options = {"worker_id": "d0", "heartbeat_seconds": 0.1, "drain_seconds": 1.0}
    worker = DecodeWorker(options, MemoryBus(BusConfig(namespace=NS), "d0", network=net))
    worker.engine = engine
    worker.start_extra = _no_ucx
    client = TestClient(TestServer(app))
    await client.start_server()
    await worker.start()
    try:
        deadline = time.monotonic() + 10
        while not app[GATEWAY_KEY].router.has_decode():  # the worker's first heartbeat
            assert time.monotonic() < deadline, "the gateway never saw the decode worker"
            await asyncio.sleep(0.02)
        yield Stack(client, worker)
    finally:
        await worker.drain_and_close()
        await client.close()


# ----------------------------------------------------------------------------- checks


@functools.cache
def published(schema: str) -> jsonschema.Draft202012Validator:
    """A validator for ``schema`` (a JSON schema whose $refs point into /openapi.json)."""
    document = openapi_spec("m")
    return jsonschema.Draft202012Validator({**json.loads(schema), **document})


def check(model: type[BaseModel], payload: Any, document_schema: dict[str, Any]) -> BaseModel:
    """``payload`` is valid by ``model`` (strict, no unknown fields) and by the schema that
    /openapi.json publishes for it."""
    parsed = model.model_validate(payload, strict=True)
    published(json.dumps(document_schema, sort_keys=True)).validate(payload)
    return parsed


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def streamed(path: str) -> dict[str, Any]:
    """The schema /openapi.json gives each server-sent event's data on ``path``."""
    content = openapi_spec("m")["paths"][path]["post"]["responses"]["200"]["content"]
    return content["text/event-stream"]["schema"]


def check_chunks(model: type[BaseModel], path: str, events: list[Any]) -> list[Any]:
    return [check(model, event, streamed(path)) for event in events]


# ----------------------------------------------------------------------------- the document


def test_openapi_publishes_the_response_models():
    spec = openapi_spec("m")
    schemas = spec["components"]["schemas"]
    assert set(RESPONSE_MODELS) <= set(schemas)
    for path, whole, chunk in [
        ("/v1/completions", "CompletionResponse", "CompletionChunk"),
        ("/v1/chat/completions", "ChatCompletionResponse", "ChatCompletionChunk"),
    ]:
        responses = spec["paths"][path]["post"]["responses"]
        content = responses["200"]["content"]
        assert content["application/json"]["schema"] == ref(whole)
        assert content["text/event-stream"]["schema"] == {"anyOf": [ref(chunk), ref("Error")]}
        for status, response in responses.items():
            if status != "200":
                assert response["content"]["application/json"]["schema"] == ref("Error")
    models = spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"] == ref("ModelList")
    card = spec["paths"]["/v1/models/{model}"]["get"]["responses"]["200"]["content"]
    assert card["application/json"]["schema"] == ref("ModelCard")
    # what issue 16 added is in the document
    assert set(schemas["CompletionLogprobs"]["required"]) == {
        "tokens",
        "token_logprobs",
        "top_logprobs",
        "text_offset",
    }
    assert schemas["CompletionLogprobs"]["properties"]["token_logprobs"]["items"]["type"] == [
        "number",
        "null",
    ]
    assert set(schemas["ChatTokenLogprob"]["required"]) == {
        "token",
        "logprob",
        "bytes",
        "top_logprobs",
    }
    assert "prompt_tokens_details" in schemas["Usage"]["required"]
    assert "prompt_tokens_details" not in schemas["RunningUsage"]["properties"]
    assert "required" not in schemas["ChatDelta"]  # role and content come and go
    for name in ("CompletionChoice", "ChatChoice", "CompletionChunkChoice", "ChatChunkChoice"):
        assert "index" in schemas[name]["required"]
        assert "logprobs" in schemas[name]["required"]  # null when not asked, never absent
    assert schemas["CompletionChoice"]["properties"]["finish_reason"]["enum"] == [
        "stop",
        "length",
    ]
    jsonschema.Draft202012Validator.check_schema({"$defs": schemas})
    targets = {ref["$ref"].rsplit("/", 1)[1] for ref in refs_in(spec)}
    assert targets <= set(schemas)  # every $ref in the document resolves


def refs_in(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if "$ref" in node else []
        return found + [r for value in node.values() for r in refs_in(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs_in(value)]
    return []


def test_models_refuse_what_the_gateway_does_not_send():
    error = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    ErrorBody.model_validate(error)
    for bad in [
        {**error, "extra": 1},
        {"error": {**error["error"], "status": 400}},
        {"error": {k: v for k, v in error["error"].items() if k != "param"}},
    ]:
        with pytest.raises(ValidationError):
            ErrorBody.model_validate(bad)


# ----------------------------------------------------------------------------- real responses


async def test_completions_with_echo_logprobs_several_choices_and_prompts(stack: Stack):
    body = {
        "prompt": ["The quick", "Paged attention"],
        "max_tokens": 4,
        "n": 2,
        "logprobs": 2,
        "echo": True,
        "seed": 1,
        "temperature": 1.0,
    }
    status, payload = await stack.post("/v1/completions", body)
    assert status == 200, payload
    answer = check(Completion, payload, ref("CompletionResponse"))
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert isinstance(answer.usage, Usage)
    for choice in answer.choices:
        logprobs = choice.logprobs
        assert logprobs is not None
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert len(logprobs.text_offset) == len(logprobs.tokens)
    for choice in answer.choices:  # echo repeats the prompt's log-probs in every choice
        logprobs = choice.logprobs
        assert logprobs is not None
        assert all(isinstance(lp, float) for lp in logprobs.token_logprobs[1:])
        assert all(top for top in logprobs.top_logprobs[1:])
    for a, b in (answer.choices[0:2], answer.choices[2:4]):
        n = len(a.logprobs.tokens) - 4  # the prompt's tokens: equal in both choices
        assert a.logprobs.token_logprobs[:n] == b.logprobs.token_logprobs[:n]


async def test_completions_best_of_and_max_tokens_zero(stack: Stack):
    body = {"prompt": "The quick", "max_tokens": 3, "n": 2, "best_of": 3, "seed": 2}
    status, payload = await stack.post("/v1/completions", body)
    assert status == 200, payload
    answer = check(Completion, payload, ref("CompletionResponse"))
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.logprobs is None for c in answer.choices)  # ranked by them, not asked
    body = {"prompt": "The quick", "max_tokens": 0, "echo": True, "logprobs": 0}
    status, payload = await stack.post("/v1/completions", body)
    assert status == 200, payload
    answer = check(Completion, payload, ref("CompletionResponse"))
    assert answer.choices[0].text == "The quick" and answer.usage.completion_tokens == 0


async def test_streamed_completions_with_running_usage(stack: Stack):
    body = {
        "prompt": "The quick",
        "max_tokens": 4,
        "n": 2,
        "logprobs": 1,
        "echo": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = await stack.stream("/v1/completions", body)
    *content, last = check_chunks(CompletionChunk, "/v1/completions", events)
    assert all(type(chunk.usage) is RunningUsage for chunk in content)
    assert last.choices == [] and type(last.usage) is Usage
    finished = [c.choices[0] for c in content if c.choices[0].finish_reason is not None]
    assert sorted(choice.index for choice in finished) == [0, 1]
    with_logprobs = [c.choices[0].logprobs for c in content if c.choices[0].logprobs]
    assert any(lp.token_logprobs[0] is None for lp in with_logprobs)  # the echoed prompt
    assert any(lp.text_offset[0] > 0 for lp in with_logprobs)  # counting across chunks


async def test_chat_completion_with_logprobs_and_several_choices(stack: Stack):
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 3,
        "temperature": 1.0,
    }
    status, payload = await stack.post("/v1/chat/completions", body)
    assert status == 200, payload
    answer = check(ChatCompletion, payload, ref("ChatCompletionResponse"))
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.logprobs is not None and len(choice.logprobs.content) == 4
        assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    status, payload = await stack.post("/v1/chat/completions", {"messages": MESSAGES})
    assert status == 200, payload
    answer = check(ChatCompletion, payload, ref("ChatCompletionResponse"))
    assert answer.choices[0].logprobs is None


@pytest.mark.parametrize("continuous", [False, True])
async def test_streamed_chat_with_usage(stack: Stack, continuous: bool):
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "stream_options": {"include_usage": True, "continuous_usage_stats": continuous},
    }
    events = await stack.stream("/v1/chat/completions", body)
    *content, last = check_chunks(ChatCompletionChunk, "/v1/chat/completions", events)
    assert last.choices == [] and type(last.usage) is Usage
    running = [type(chunk.usage) for chunk in content]
    assert running == [RunningUsage if continuous else type(None)] * len(content)
    deltas = [chunk.choices[0].delta for chunk in content]
    assert sum(d.role == "assistant" for d in deltas) == 2  # each choice's first chunk
    assert any(d.content for d in deltas)
    assert sum(d.role is None and d.content is None for d in deltas) == 2  # the last ones
    assert any(chunk.choices[0].logprobs for chunk in content)
    # without include_usage, no chunk has a usage key
    events = await stack.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert all("usage" not in event for event in events)
    check_chunks(ChatCompletionChunk, "/v1/chat/completions", events)


async def test_errors_and_models(stack: Stack):
    for path, body, status in [
        ("/v1/completions", {"prompt": "x", "n": 17}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404),
    ]:
        code, payload = await stack.post(path, body)
        assert code == status
        error = check(ErrorBody, payload, ref("Error"))
        assert error.error.param is not None
    response = await stack.client.get("/v1/models")
    listing = check(ModelList, await response.json(), ref("ModelList"))
    assert listing.data[0].id == stack.model
    response = await stack.client.get(f"/v1/models/{stack.model}")
    check(ModelCard, await response.json(), ref("ModelCard"))


async def test_an_error_after_the_stream_began_is_an_error_event(stack: Stack):
    body = {"messages": MESSAGES, "max_tokens": LONG, "ignore_eos": True}
    events = []
    async for event in stack.events("/v1/chat/completions", body):
        if not events:  # the stream is open: its request fails on the worker
            (state,) = stack.worker.states.values()
            await stack.worker.fail(state, "internal", "injected failure")
        events.append(event)
    *content, error = events
    check_chunks(ChatCompletionChunk, "/v1/chat/completions", content)
    assert check(ErrorBody, error, streamed("/v1/chat/completions")).error.code == "internal"
    assert len(content) < LONG


# ----------------------------------------------------------------------------- strictness


def mutations(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """``payload`` with one field added, renamed or nulled, at each level that has one."""
    out = []
    choice = payload["choices"][0]
    for target, key in [(payload, "id"), (choice, "index")]:
        added = copy.deepcopy(payload)
        (added if target is payload else added["choices"][0])["system_fingerprint"] = "x"
        out.append(added)
        renamed = copy.deepcopy(payload)
        where = renamed if target is payload else renamed["choices"][0]
        where[key + "_"] = where.pop(key)
        out.append(renamed)
    logprobs = copy.deepcopy(payload)
    lp = logprobs["choices"][0]["logprobs"]
    if "content" in lp:
        lp["content"][0]["top_logprobs"][0]["rank"] = 1
    else:
        lp["text_offsets"] = lp.pop("text_offset")
    out.append(logprobs)
    usage = copy.deepcopy(payload)
    usage["usage"]["prompt_tokens_details"]["audio_tokens"] = 0
    out.append(usage)
    return out


@pytest.mark.parametrize("chat", [False, True])
async def test_a_field_sent_without_its_model_fails(stack: Stack, chat: bool):
    if chat:
        path, model = "/v1/chat/completions", ChatCompletion
        body = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    else:
        path, model = "/v1/completions", Completion
        body = {"prompt": "The quick", "max_tokens": 2, "logprobs": 1}
    status, payload = await stack.post(path, body)
    assert status == 200, payload
    model.model_validate(payload, strict=True)
    for changed in mutations(payload):
        with pytest.raises(ValidationError):
            model.model_validate(changed, strict=True)
