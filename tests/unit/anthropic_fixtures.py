"""What the Messages API tests share: a test model, a request answered by the scripted decode
worker, Anthropic's SSE read strictly (an ``event:`` line, a ``data:`` line, a blank line, the
event's name its data's ``type``), each body held to the response models and to the schema
``/openapi.json`` publishes, and a stream accumulated as a client does."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import jsonschema

from pdserve.gateway.anthropic.response_models import STREAM_EVENTS, AnthropicMessage
from pdserve.gateway.openapi import openapi_spec
from tests.unit.fake_workers import MODEL, FakeWorker

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ASK = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def answered(
    client: Any,
    d0: FakeWorker,
    body: dict[str, Any],
    ids: list[int],
    per_event: int,
    finish: str = "stop",
    headers: dict[str, str] | None = None,
) -> Any:
    """POST ``body`` to /v1/messages; the worker sends ``ids`` ``per_event`` tokens at a time.
    The response (its body not read yet)."""
    reply = asyncio.create_task(client.post("/v1/messages", json=body, headers=headers))
    request = await d0.next_request()
    groups = [ids[i : i + per_event] for i in range(0, len(ids), per_event)]
    for i, group in enumerate(groups):
        await d0.tokens(request, group, finish if i == len(groups) - 1 else None)
    return await asyncio.wait_for(reply, 10)


async def message(client: Any, d0: FakeWorker, body: dict[str, Any], ids: list[int], *args: Any):
    """The whole answer to ``body``, valid as published."""
    response = await answered(client, d0, {**body, "stream": False}, ids, *args)
    assert response.status == 200, await response.text()
    payload = await response.json()
    valid_message(payload)
    return payload


async def streamed(client: Any, d0: FakeWorker, body: dict[str, Any], ids: list[int], *args: Any):
    """The events of the streamed answer to ``body``: [(name, data)], each valid as published."""
    response = await answered(client, d0, {**body, "stream": True}, ids, *args)
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return sse_events(await response.text())


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    assert text.endswith("\n\n"), text[-200:]
    for block in text[:-2].split("\n\n"):
        event_line, data_line = block.split("\n")  # exactly two lines per event
        name = event_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert data["type"] == name
        STREAM_EVENTS[name].model_validate(data, strict=True)
        _published("text/event-stream").validate(data)
        events.append((name, data))
    return events


@functools.cache
def _published(kind: str) -> jsonschema.Draft202012Validator:
    document = openapi_spec("m")
    schema = document["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"][kind]
    return jsonschema.Draft202012Validator({**schema["schema"], **document})


def valid_message(payload: dict[str, Any]) -> None:
    AnthropicMessage.model_validate(payload, strict=True)
    _published("application/json").validate(payload)


def accumulated(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message a client builds from a stream (what Anthropic's SDK does), written apart from
    the gateway's own ``events.content_of``."""
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    message = dict(events[0][1]["message"])
    content: list[dict[str, Any]] = []
    message["content"] = content
    partial: dict[int, str] = {}
    open_index = None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(content)  # one block at a time
            content.append(dict(data["content_block"]))
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta, block = data["delta"], content[data["index"]]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    for index, text in partial.items():
        content[index]["input"] = json.loads(text)
    ended = events[-2][1]
    message.update(ended["delta"], usage=ended["usage"])
    return message


def without_call_ids(payload: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool_use ids (new on every answer) and its id left out."""
    content = [{k: v for k, v in b.items() if k != "id"} for b in payload["content"]]
    return {**{k: v for k, v in payload.items() if k != "id"}, "content": content}
