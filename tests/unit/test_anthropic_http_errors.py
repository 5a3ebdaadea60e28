"""``/v1/messages`` when things go wrong, through the real app on the in-memory bus: every
failure in Anthropic's shape and status (bad bodies, unknown model or path, too large, no
worker, a worker failing before or during a stream), API keys in ``x-api-key`` or as a Bearer
token, a client that goes away (its request is cancelled on the worker), and the accounting
that is the chat endpoint's (metrics by endpoint and finish reason, the request span's GenAI
attributes). ``count_tokens`` and ``/openapi.json`` too."""

from __future__ import annotations

import asyncio
import json

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.gateway import middlewares
from pdserve.gateway.anthropic.response_models import AnthropicError
from pdserve.gateway.openapi import openapi_spec
from pdserve.shared.telemetry import tracing as tr
from tests.unit.anthropic_fixtures import ASK, WEATHER, message, sse_events
from tests.unit.fake_workers import MODEL, settle
from tests.unit.gateway_fixtures import serving


async def error_of(response, status: int, kind: str) -> str:
    """The message of an Anthropic-shaped error response of ``status`` and ``kind``."""
    assert response.status == status, await response.text()
    body = await response.json()
    AnthropicError.model_validate(body, strict=True)
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


async def test_bad_requests_are_anthropic_errors(model_dir):
    async with serving(model_dir, max_body_bytes=4096) as (client, _):
        post = client.post
        message = await error_of(
            await post("/v1/messages", json={"model": MODEL}), 400, "invalid_request_error"
        )
        assert "'messages' is required" in message
        bad_json = await post(
            "/v1/messages", data=b"{", headers={"Content-Type": "application/json"}
        )
        assert "not valid JSON" in await error_of(bad_json, 400, "invalid_request_error")
        unknown = await post("/v1/messages", json={**ASK, "model": "claude-x"})
        assert "claude-x" in await error_of(unknown, 404, "not_found_error")
        await error_of(await post("/v1/messages/nope", json=ASK), 404, "not_found_error")
        big = {**ASK, "system": "x" * 8192}
        await error_of(await post("/v1/messages", json=big), 413, "request_too_large")
        too_long = {**ASK, "max_tokens": 5000}  # past the 4096-token context
        await error_of(await post("/v1/messages", json=too_long), 400, "invalid_request_error")
        conversation = {"model": "claude-x", "messages": ASK["messages"]}
        counted = await post("/v1/messages/count_tokens", json=conversation)
        await error_of(counted, 404, "not_found_error")
        bad_id = await post("/v1/messages", json=ASK, headers={"x-request-id": "no spaces"})
        assert "x-request-id" in await error_of(bad_id, 400, "invalid_request_error")
        count_with_sampling = await post("/v1/messages/count_tokens", json=ASK)
        assert "max_tokens" in await error_of(count_with_sampling, 400, "invalid_request_error")
        # the OpenAI endpoints keep OpenAI's shape
        chat = await post("/v1/chat/completions", json={"model": MODEL})
        assert chat.status == 400 and set(await chat.json()) == {"error"}


async def test_no_decode_worker_is_overloaded_529(model_dir):
    async with serving(model_dir) as (client, d0):
        await d0.leave()
        await settle()
        response = await client.post("/v1/messages", json=ASK)
        await error_of(response, 529, "overloaded_error")
        assert response.headers["Retry-After"] == "1"


async def test_a_worker_failure_before_and_during_the_stream(model_dir, tok):
    """Before the first piece: a real status (502, api_error). Mid-stream: an ``error`` event
    ends the stream, and no message_stop makes the cut answer look complete."""
    ids = tok.encode("Sunny and warm today.", add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        for stream in (False, True):
            reply = asyncio.create_task(client.post("/v1/messages", json={**ASK, "stream": stream}))
            await d0.refuse(await d0.next_request(), code="internal", error="engine failed")
            await error_of(await asyncio.wait_for(reply, 10), 502, "api_error")
        reply = asyncio.create_task(client.post("/v1/messages", json={**ASK, "stream": True}))
        request = await d0.next_request()
        await d0.tokens(request, ids[:3])
        await d0.refuse(request, code="internal", error="engine failed")
        response = await asyncio.wait_for(reply, 10)
        events = sse_events(await response.text())
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and "message_stop" not in names
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error"
    assert "engine failed" in data["error"]["message"]


async def test_api_keys_in_x_api_key_or_bearer(model_dir, tok):
    ids = tok.encode("Hi.", add_special_tokens=False).ids
    version = {"anthropic-version": "2099-01-01"}  # tolerated, whatever it says
    async with serving(model_dir, api_key=["key-one", "key-two"]) as (client, d0):
        missing = await client.post("/v1/messages", json=ASK, headers=version)
        assert "x-api-key" in await error_of(missing, 401, "authentication_error")
        wrong = await client.post("/v1/messages", json=ASK, headers={"x-api-key": "nope"})
        await error_of(wrong, 401, "authentication_error")
        for key in ({"x-api-key": "key-two"}, {"Authorization": "Bearer key-one"}):
            await message(client, d0, ASK, ids, 2, "stop", {**key, **version})
        # x-api-key works on the OpenAI endpoints too; their errors stay OpenAI's
        chat = {"model": MODEL, "max_tokens": 8, "messages": ASK["messages"]}
        reply = asyncio.create_task(
            client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "key-one"})
        )
        await d0.tokens(await d0.next_request(), ids, "stop")
        assert (await asyncio.wait_for(reply, 10)).status == 200
        denied = await client.post("/v1/chat/completions", json=chat)
        assert denied.status == 401 and (await denied.json())["error"]["code"] == "invalid_api_key"


async def test_a_client_that_goes_away_cancels_the_request(model_dir, tok):
    ids = tok.encode("Sunny", add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        reply = asyncio.create_task(client.post("/v1/messages", json={**ASK, "stream": True}))
        request = await d0.next_request()
        await d0.tokens(request, ids[:1])
        response = await asyncio.wait_for(reply, 10)
        assert (await response.content.readuntil(b"\n\n")).startswith(b"event: message_start")
        response.close()  # the client hangs up mid-stream
        for _ in range(1000):  # up to 10 s: the server notices the hang-up on its next write
            if request.bus_id in d0.cancels:
                break
            await asyncio.sleep(0.01)
        assert request.bus_id in d0.cancels
        metrics = await (await client.get("/metrics")).text()
    assert 'pdserve_requests_total{finish_reason="abort"} 1.0' in metrics


async def test_metrics_and_the_request_span_are_the_chat_endpoints(model_dir, tok, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(middlewares, "_tracer", provider.get_tracer("test"))
    ids = tok.encode("Sunny.", add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        answer = await message(client, d0, ASK, ids, 2)
        metrics = await (await client.get("/metrics")).text()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/messages"]
    attributes = span.attributes or {}
    assert attributes[tr.GEN_AI_OPERATION_NAME] == "chat"
    assert attributes[tr.GEN_AI_REQUEST_MODEL] == MODEL
    assert attributes[tr.GEN_AI_USAGE_OUTPUT_TOKENS] == answer["usage"]["output_tokens"]
    usage = answer["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert attributes[tr.GEN_AI_USAGE_INPUT_TOKENS] == prompt
    assert 'pdserve_http_requests_total{endpoint="/v1/messages",status="200"} 1.0' in metrics
    assert 'pdserve_requests_total{finish_reason="stop"} 1.0' in metrics


async def test_count_tokens_counts_the_prompt_of_the_chat_conversation(model_dir):
    """The same count /tokenize gives the chat endpoint's rendering of the same conversation
    (tools in the prompt included)."""
    body = {"model": MODEL, "system": "Be brief.", "messages": ASK["messages"], "tools": [WEATHER]}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    chat = {
        "model": MODEL,
        "tools": tools,
        "messages": [{"role": "system", "content": "Be brief."}, *ASK["messages"]],
    }
    async with serving(model_dir) as (client, _):
        counted = await (await client.post("/v1/messages/count_tokens", json=body)).json()
        tokenized = await (await client.post("/tokenize", json=chat)).json()
        without_tools = {k: v for k, v in body.items() if k != "tools"}
        fewer = await (await client.post("/v1/messages/count_tokens", json=without_tools)).json()
    assert counted == {"input_tokens": tokenized["count"]}
    assert fewer["input_tokens"] < counted["input_tokens"]


def test_openapi_documents_both_paths():
    document = openapi_spec("m")
    messages = document["paths"]["/v1/messages"]["post"]
    count = document["paths"]["/v1/messages/count_tokens"]["post"]
    assert messages["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/MessagesRequest"
    }
    assert set(messages["responses"]) >= {"200", "400", "401", "404", "529"}
    assert {"x-api-key": []} in messages["security"] and {"x-api-key": []} in count["security"]
    schemas = document["components"]["schemas"]
    request = schemas["MessagesRequest"]
    assert (
        "max_tokens" in request["required"] and request["properties"]["temperature"]["maximum"] == 1
    )
    assert "max_tokens" not in schemas["CountTokensRequest"]["properties"]
    assert document["components"]["securitySchemes"]["x-api-key"]["in"] == "header"
    events = messages["responses"]["200"]["content"]["text/event-stream"]["schema"]["anyOf"]
    assert {"$ref": "#/components/schemas/PingEvent"} in events


async def test_structured_output_reaches_the_worker_and_a_bad_schema_is_named(model_dir, tok):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    form = {"format": {"type": "json_schema", "schema": schema}}
    ids = tok.encode('{"city": "Paris"}', add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        answer = await message(client, d0, {**ASK, "output_config": form}, ids, 3)
        guided = d0.received[-1].sampling.guided
        broken = {"format": {"type": "json_schema", "schema": {"$ref": "#/$defs/missing"}}}
        refused = await client.post("/v1/messages", json={**ASK, "output_config": broken})
        message_text = await error_of(refused, 400, "invalid_request_error")
    assert guided is not None and guided.kind == "json_schema" and json.loads(guided.spec) == schema
    assert answer["content"] == [{"type": "text", "text": '{"city": "Paris"}'}]
    assert "Invalid structured output" in message_text
