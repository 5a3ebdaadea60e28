"""Tool calls in the gateway's answers, through the real app (HTTP, the in-memory bus, a
scripted decode worker that sends the tokens of what a model wrote): the whole answer's
``content``, ``tool_calls`` and ``finish_reason``; the streamed chunks in OpenAI's shape,
joined to exactly the whole answer however the tokens are grouped into events; and every body
valid by the response models and the schema /openapi.json publishes."""

from __future__ import annotations

import asyncio
import functools
import json

import jsonschema
import pytest

from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.response_models import ChatCompletion, ChatCompletionChunk
from pdserve.gateway.tools.stream import joined
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
    "tools": [WEATHER, NOOP],
}
# what Qwen2.5 writes (the test model's template has no tool syntax: the hermes fallback)
ANSWER = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]


async def answered(client, d0, body: dict, ids: list[int], per_event: int, finish: str = "stop"):
    """POST ``body``; the worker sends ``ids`` ``per_event`` tokens at a time. The JSON body,
    or with ``stream`` the events' payloads."""
    reply = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await d0.next_request()
    groups = [ids[i : i + per_event] for i in range(0, len(ids), per_event)]
    for i, group in enumerate(groups):
        await d0.tokens(request, group, finish if i == len(groups) - 1 else None)
    response = await asyncio.wait_for(reply, 10)
    assert response.status == 200, await response.text()
    if not body.get("stream"):
        return await response.json()
    text = await response.text()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@functools.cache
def _published(path: str, kind: str) -> jsonschema.Draft202012Validator:
    document = openapi_spec("m")
    schema = document["paths"][path]["post"]["responses"]["200"]["content"][kind]["schema"]
    return jsonschema.Draft202012Validator({**schema, **document})


def valid(model, payload, kind: str) -> None:
    model.model_validate(payload, strict=True)
    _published("/v1/chat/completions", kind).validate(payload)


def rebuilt(events: list[dict]) -> tuple[str, list[tuple[str, str]], str | None]:
    """What a client rebuilds from a stream: content, calls, the finish reason."""
    deltas, finish = [], None
    for event in events:
        valid(ChatCompletionChunk, event, "text/event-stream")
        for choice in event["choices"]:
            deltas.append({k: v for k, v in choice["delta"].items() if k != "role"})
            finish = choice["finish_reason"] or finish
    content, calls = joined(deltas)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], finish


async def test_a_whole_answer_with_calls(model_dir, tok):
    ids = tok.encode(ANSWER, add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        body = await answered(client, d0, CHAT, ids, 3)
        valid(ChatCompletion, body, "application/json")
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "Let me check both."
        assert [c["type"] for c in message["tool_calls"]] == ["function"] * 2
        ids_ = [c["id"] for c in message["tool_calls"]]
        assert len(set(ids_)) == 2 and all(i.startswith("call_") for i in ids_)
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert got == CALLS

        # only calls: content null; parallel_tool_calls false: the first call only
        only = ANSWER.split("\n", 1)[1]
        ids = tok.encode(only, add_special_tokens=False).ids
        body = await answered(client, d0, {**CHAT, "parallel_tool_calls": False}, ids, 50)
        message = body["choices"][0]["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1

        # tool_choice none: the same text is all content, as written
        body = await answered(client, d0, {**CHAT, "tool_choice": "none"}, ids, 50)
        assert body["choices"][0]["message"] == {"role": "assistant", "content": only}
        assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("per_event", [1, 2, 7, 1000])
async def test_the_stream_joins_to_the_whole_answer(model_dir, tok, per_event):
    ids = tok.encode(ANSWER + "\nDone.", add_special_tokens=False).ids
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with serving(model_dir) as (client, d0):
        whole = await answered(client, d0, CHAT, ids, per_event)
        events = await answered(client, d0, stream, ids, per_event)
    content, calls, finish = rebuilt(events)
    message = whole["choices"][0]["message"]
    assert (
        (content, finish)
        == (message["content"], "tool_calls")
        == ("Let me check both.\nDone.", "tool_calls")
    )
    assert calls == CALLS
    first = [
        c["delta"]["tool_calls"][0]
        for e in events
        for c in e["choices"]
        if "tool_calls" in c["delta"] and "id" in c["delta"]["tool_calls"][0]
    ]
    assert [f["index"] for f in first] == [0, 1]
    assert all(f["function"]["arguments"] == "" and f["type"] == "function" for f in first)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(ids)


async def test_a_call_cut_by_max_tokens_is_content_and_ends_with_length(model_dir, tok):
    cut = ANSWER[: ANSWER.index("Paris")]
    ids = tok.encode(cut, add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        body = await answered(client, d0, CHAT, ids, 4, finish="length")
        events = await answered(client, d0, {**CHAT, "stream": True}, ids, 4, finish="length")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": cut}
    assert body["choices"][0]["finish_reason"] == "length"
    assert rebuilt(events) == (cut, [], "length")


async def test_the_openai_client_rebuilds_the_same_message(model_dir, tok):
    """The ``openai`` package over real HTTP: its own stream accumulator makes of the chunks
    the message the whole answer has."""
    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    ids = tok.encode(ANSWER, add_special_tokens=False).ids
    async with serving(model_dir) as (client, d0):
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none")

        async def worker() -> None:
            request = await d0.next_request()
            for i in range(0, len(ids), 5):
                await d0.tokens(request, ids[i : i + 5], "stop" if i + 5 >= len(ids) else None)

        whole, _ = await asyncio.gather(api.chat.completions.create(**CHAT), worker())
        state = ChatCompletionStreamState()
        stream, _ = await asyncio.gather(api.chat.completions.create(**CHAT, stream=True), worker())
        async for chunk in stream:
            state.handle_chunk(chunk)
        await api.close()
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == whole.choices[0].finish_reason == "tool_calls"
    for message in (final.message, whole.choices[0].message):
        assert message.content == "Let me check both."
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == CALLS
