"""What the /v1/responses tests share: a request answered by the scripted decode worker, the
stream read back as events, each event and response checked against the ``openai`` package's
own types, and a stream rebuilt by the SDK's own accumulator (what ``responses.stream`` does)."""

from __future__ import annotations

import asyncio
import functools
import json
import typing
from typing import Any

import jsonschema
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.responses.schemas import MODELS
from tests.unit.fake_workers import MODEL

# each event type's model in the openai package (its union is discriminated by "type")
EVENT_MODELS = {
    model.model_fields["type"].annotation.__args__[0]: model
    for model in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    components = openapi_spec("m")["components"]
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": components}
    )


def published(payload: dict[str, Any], name: str = "Response") -> None:
    """``payload`` fits its model (``gateway/responses/schemas.py``) and the schema
    /openapi.json publishes under ``name``."""
    MODELS[name].model_validate(payload, strict=True)
    _validator(name).validate(payload)


def event_model(event: dict[str, Any]) -> Any:
    """The event as the ``openai`` package's model of its type (validated)."""
    return EVENT_MODELS[event["type"]].model_validate(event)


def ask(said: Any = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": said, **fields}


async def responded(
    client, d0, body: dict, ids: list[int], per_event: int = 3, finish: str = "stop"
) -> tuple[Any, Any]:
    """POST ``body`` to /v1/responses; the worker sends ``ids`` ``per_event`` tokens at a time.
    (the worker's request, the JSON body or with ``stream`` the list of events)."""
    reply = asyncio.create_task(client.post("/v1/responses", json=body))
    request = await d0.next_request()
    groups = [ids[i : i + per_event] for i in range(0, len(ids), per_event)] or [[]]
    for i, group in enumerate(groups):
        await d0.tokens(request, group, finish if i == len(groups) - 1 else None)
    response = await asyncio.wait_for(reply, 10)
    assert response.status == 200, await response.text()
    if not body.get("stream"):
        payload = await response.json()
        Response.model_validate(payload)
        published(payload)
        return request, payload
    return request, read_events(await response.text())


def read_events(text: str) -> list[dict[str, Any]]:
    """The events of a stream, each checked: ``event:`` names its data's type, the sequence
    numbers count from 0, and the ``openai`` package's types accept it."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        assert event["sequence_number"] == len(events)
        event_model(event)
        published(event, "ResponseStreamEvent")
        events.append(event)
    return events


def sdk_rebuilt(events: list[dict[str, Any]], tools: list[dict] | None = None) -> Response:
    """The final response the SDK's stream accumulator makes of the events."""
    state = ResponseStreamState(input_tools=tools or omit, text_format=omit)
    assert events[-1]["type"] == "response.completed", events[-1]["type"]
    handled: list[Any] = []
    for event in events:
        handled = state.handle_event(event_model(event))
    return handled[-1].response


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]
