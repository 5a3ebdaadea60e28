"""/v1/responses through the real app (HTTP, the in-memory bus, a scripted decode worker that
sends the tokens of what a model wrote, a response store in memory): the response object, the
stream's event sequence in OpenAI's order with its sequence numbers, each event valid by the
``openai`` package's types and the stream rebuilt by its own accumulator to exactly the whole
answer, function calls as output items and back as input, reasoning items, the token limit as
``incomplete``, structured output, and failures."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from pdserve.shared.bus.request_messages import DecodeRequest
from tests.unit.conftest import ids_of
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving
from tests.unit.memory_store import MemoryResponseStore
from tests.unit.responses_support import ask, read_events, responded, sdk_rebuilt, types
from tests.unit.test_tool_calls_http import ANSWER as CALLING

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
TEXT_ITEM = ["output_item.added", "content_part.added"]
TEXT_DONE = ["output_text.done", "content_part.done", "output_item.done"]


def prompt_of(tok: Tokenizer, request: DecodeRequest) -> str:
    return tok.decode(request.prompt_token_ids, skip_special_tokens=False)


async def test_a_whole_response(model_dir, tok):
    body = ask(
        "Hi",
        instructions="Be brief.",
        max_output_tokens=50,
        temperature=0.5,
        top_p=0.9,
        metadata={"k": "v"},
    )
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        request, out = await responded(client, d0, body, ids_of(tok, "Hello there."))
    assert (
        prompt_of(tok, request) == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    )
    assert request.sampling.temperature == 0.5 and request.sampling.top_p == pytest.approx(0.9)
    assert request.sampling.max_tokens == 50
    assert out["id"].startswith("resp_") and out["object"] == "response"
    assert (out["status"], out["error"], out["incomplete_details"]) == ("completed", None, None)
    (message,) = out["output"]
    assert message["id"].startswith("msg_") and message["role"] == "assistant"
    assert message["status"] == "completed"
    assert message["content"] == [
        {"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}
    ]
    assert (out["instructions"], out["max_output_tokens"], out["metadata"]) == (
        "Be brief.",
        50,
        {"k": "v"},
    )
    assert (out["temperature"], out["top_p"], out["store"], out["model"]) == (0.5, 0.9, True, MODEL)
    usage = out["usage"]
    assert usage["input_tokens"] == len(request.prompt_token_ids)
    assert usage["output_tokens"] == len(ids_of(tok, "Hello there."))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("per_event", [1, 4, 1000])
async def test_the_stream_in_openais_order_joins_to_the_whole_answer(model_dir, tok, per_event):
    ids = ids_of(tok, "Hello there, world.")
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        _, whole = await responded(client, d0, ask(), ids, per_event)
        _, events = await responded(client, d0, ask(stream=True), ids, per_event)
    deltas = len([e for e in events if e["type"] == "response.output_text.delta"])
    assert types(events) == ["created", "in_progress", *TEXT_ITEM] + [
        "output_text.delta"
    ] * deltas + [*TEXT_DONE, "completed"]
    assert deltas == -(-len(ids) // per_event) or per_event == 1
    created, final = events[0]["response"], events[-1]["response"]
    assert (
        created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    )
    assert created["id"] == final["id"] and final["status"] == "completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] == "Hello there, world."
    rebuilt = sdk_rebuilt(events)
    assert rebuilt.output_text == "Hello there, world." and rebuilt.id == final["id"]
    item_id = events[2]["item"]["id"]
    assert all(e.get("item_id", item_id) == item_id for e in events[2:-1])
    assert final["output"][0]["id"] == item_id and final["usage"] == {**whole["usage"]}


async def test_function_calls_are_output_items(model_dir, tok):
    ids = ids_of(tok, CALLING + "\nDone.")
    body = ask("Weather in Paris and Rome?", tools=[WEATHER])
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        request, whole = await responded(client, d0, body, ids, 2)
        _, events = await responded(client, d0, {**body, "stream": True}, ids, 2)
    assert "get_weather" in prompt_of(tok, request)  # the tools are in the prompt
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["message", "function_call", "function_call", "message"]
    calls = [(i["name"], i["arguments"]) for i in whole["output"] if i["type"] == "function_call"]
    assert calls == CALLS
    for item in whole["output"][1:3]:
        assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
        assert item["status"] == "completed"
    texts = [i["content"][0]["text"] for i in whole["output"] if i["type"] == "message"]
    assert texts == ["Let me check both.", "\nDone."]
    # each call is one item: added, its arguments in one delta (a call is sent whole), done
    call = ["output_item.added", "function_call_arguments.delta"]
    call += ["function_call_arguments.done", "output_item.done"]
    items = [t for t in types(events) if "function_call" in t or t.startswith("output_item")]
    assert items == ["output_item.added", "output_item.done", *call, *call] + items[-2:]
    assert items[-2:] == ["output_item.added", "output_item.done"]  # the text after the calls
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == CALLS
    rebuilt = sdk_rebuilt(events, [WEATHER])
    got = [(i.name, i.arguments) for i in rebuilt.output if i.type == "function_call"]
    assert got == CALLS and rebuilt.output_text == "Let me check both.\nDone."


async def test_a_function_round_trip_through_previous_response_id(model_dir, tok):
    only_call = CALLING.split("\n", 1)[1].rsplit("\n<tool_call>", 1)[0]
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        body = ask("Weather in Paris?", tools=[WEATHER], instructions="Use tools.")
        _, first = await responded(client, d0, body, ids_of(tok, only_call))
        (call,) = first["output"]
        assert call["type"] == "function_call"
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        follow = ask([result], tools=[WEATHER], previous_response_id=first["id"])
        request, second = await responded(client, d0, follow, ids_of(tok, "It is sunny."))
        assert second["previous_response_id"] == first["id"]
        assert second["output"][0]["content"][0]["text"] == "It is sunny."
        prompt = prompt_of(tok, request)
        # the stored conversation, then the result; instructions are not carried over
        assert "Weather in Paris?" in prompt and "sunny" in prompt and "Use tools." not in prompt
        assert prompt.index('"city": "Paris"') < prompt.index("sunny")
        # an output naming no call made in the conversation is refused, naming it
        stray = ask([{**result, "call_id": "call_nope"}], previous_response_id=first["id"])
        response = await client.post("/v1/responses", json=stray)
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "input[0].call_id"


async def test_the_token_limit_makes_the_response_incomplete(model_dir, tok):
    ids = ids_of(tok, "Hello there")
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        _, whole = await responded(client, d0, ask(max_output_tokens=len(ids)), ids, 2, "length")
        _, events = await responded(client, d0, ask(stream=True), ids, 2, "length")
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete"
    assert types(events)[-2:] == ["output_item.done", "incomplete"]
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_reasoning_is_an_item_of_its_own(thinking_dir, tok):
    answer = "I should greet.\n</think>\n\nHello!"
    async with serving(
        thinking_dir, response_store=MemoryResponseStore(), reasoning_parser="qwen3"
    ) as (client, d0):
        _, whole = await responded(client, d0, ask(), ids_of(tok, answer), 2)
        _, events = await responded(client, d0, ask(stream=True), ids_of(tok, answer), 2)
        follow = ask("And?", previous_response_id=whole["id"])
        request, _ = await responded(client, d0, follow, ids_of(tok, "Bye."))
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I should greet."}]
    assert reasoning["summary"] == []
    assert message["content"][0]["text"] == "Hello!"
    counted = len(ids_of(tok, "I should greet."))
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": counted}
    assert types(events)[2:5] == ["output_item.added", "content_part.added", "reasoning_text.delta"]
    assert "reasoning_text.done" in types(events)
    # sent back, the reasoning reaches the template with the assistant message after it
    assert "<think>I should greet.</think>Hello!" in prompt_of(tok, request)


async def test_text_format_is_the_chat_endpoints_structured_output(model_dir, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        request, out = await responded(
            client, d0, ask(text={"format": fmt}), ids_of(tok, '{"a": 1}')
        )
        assert request.sampling.guided.kind == "json_schema"
        assert out["text"] == {"format": fmt}
        bad = ask(text={"format": {**fmt, "schema": {"type": "nonsense"}}})
        response = await client.post("/v1/responses", json=bad)
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "text.format"


async def test_failures_are_an_http_error_or_a_failed_response(model_dir, tok):
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        reply = asyncio.create_task(client.post("/v1/responses", json=ask()))
        await d0.refuse(await d0.next_request(), code="internal", error="boom")
        response = await asyncio.wait_for(reply, 10)
        assert response.status == 502  # nothing streamed yet: a real status
        reply = asyncio.create_task(client.post("/v1/responses", json=ask(stream=True)))
        request = await d0.next_request()
        await d0.tokens(request, ids_of(tok, "Hel"))
        await d0.refuse(request, code="internal", error="boom")
        events = read_events(await (await asyncio.wait_for(reply, 10)).text())
    assert types(events)[-1] == "failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "boom" in failed["error"]["message"] and "(internal)" in failed["error"]["message"]
