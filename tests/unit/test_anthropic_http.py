"""``POST /v1/messages`` through the real app (HTTP, the in-memory bus, a scripted decode worker
that sends the tokens of what a model wrote): the whole message and Anthropic's event stream,
joined to exactly the whole message however the tokens are grouped into events; text, tool_use
and thinking blocks; stop reasons; usage with the prefix cache's hits; the prompt and sampling
the worker gets, identical to the chat endpoint's for the same conversation; and reasoning read
once. Errors, keys and cancellation: test_anthropic_http_errors.py."""

from __future__ import annotations

import asyncio
import dataclasses

import anthropic
import pytest

from pdserve.gateway import reasoning
from pdserve.shared.bus.stream_messages import TokenBatch
from tests.unit.anthropic_fixtures import (
    ASK,
    CALL,
    WEATHER,
    accumulated,
    message,
    streamed,
    without_call_ids,
)
from tests.unit.conftest import ids_of
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving

ANSWER = "It is sunny in Paris."
THOUGHT = "The user wants the weather."


async def test_a_whole_message_with_its_usage(model_dir, tok):
    """input_tokens + cache_read_input_tokens is the prompt (what count_tokens says); the cached
    part is what the worker's prefix cache served."""
    ids = ids_of(tok, ANSWER)
    async with serving(model_dir) as (client, d0):
        count = await client.post("/v1/messages/count_tokens", json=dict(ASK, max_tokens=None))
        prompt = (await count.json())["input_tokens"]
        headers = {"x-request-id": "req-1", "anthropic-version": "2023-06-01"}
        reply = asyncio.create_task(client.post("/v1/messages", json=ASK, headers=headers))
        request = await d0.next_request()
        first = dataclasses.replace(d0.item(request, ids[:2]), cached_tokens=5)
        await d0.bus.publish(request.reply_to, TokenBatch([first]))
        await d0.tokens(request, ids[2:], "stop")
        response = await asyncio.wait_for(reply, 10)
        payload = await response.json()
    assert len(request.prompt_token_ids) == prompt
    assert payload == {
        "id": "msg_req-1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": ANSWER}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": prompt - 5,
            "output_tokens": len(ids),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 5,
        },
    }
    assert response.headers["x-request-id"] == "req-1"


async def test_the_stream_is_anthropics_event_sequence(model_dir, tok):
    ids = ids_of(tok, ANSWER)
    async with serving(model_dir) as (client, d0):
        whole = await message(client, d0, ASK, ids, 2)
        events = await streamed(client, d0, ASK, ids, 2)
    deltas = len([n for n, _ in events if n == "content_block_delta"])
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["stop_sequence"]) == ([], None, None)
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert without_call_ids(accumulated(events)) == without_call_ids(whole)


@pytest.mark.parametrize("per_event", [1, 2, 7, 1000])
async def test_thinking_text_and_tool_use_blocks_whole_and_streamed(model_dir, tok, per_event):
    text = f"<think>\n{THOUGHT}\n</think>\n\nLet me check.\n{CALL}"
    body = {**ASK, "tools": [WEATHER]}
    async with serving(model_dir, reasoning_parser="qwen3") as (client, d0):
        whole = await message(client, d0, body, ids_of(tok, text), per_event)
        events = await streamed(client, d0, body, ids_of(tok, text), per_event)
    content = whole["content"]
    assert [b["type"] for b in content] == ["thinking", "text", "tool_use"]
    assert content[0] == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    assert content[1] == {"type": "text", "text": "Let me check."}
    assert content[2]["name"] == "get_weather" and content[2]["input"] == {"city": "Paris"}
    assert content[2]["id"].startswith("toolu_") and len(content[2]["id"]) > len("toolu_")
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("tool_use", None)
    assert without_call_ids(accumulated(events)) == without_call_ids(whole)
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert "thinking_delta" in kinds and kinds[-1] == "input_json_delta"


async def test_reasoning_is_read_once(model_dir, tok, monkeypatch):
    """One incremental reader per answer, whole or streamed: the whole message is not split
    again from its text (Dynamo read an Anthropic stream's reasoning twice)."""
    made = []
    original = reasoning.ReasoningSplitter.__init__

    def counted(self, setup):
        made.append(setup)
        original(self, setup)

    def split_again(*args):
        raise AssertionError("the answer's reasoning was read a second time")

    monkeypatch.setattr(reasoning.ReasoningSplitter, "__init__", counted)
    monkeypatch.setattr(reasoning, "split", split_again)
    monkeypatch.setattr("pdserve.gateway.whole_answer.split", split_again)
    ids = ids_of(tok, f"<think>{THOUGHT}</think>{ANSWER}")
    async with serving(model_dir, reasoning_parser="deepseek_r1") as (client, d0):
        whole = await message(client, d0, ASK, ids, 3)
        assert len(made) == 1
        events = await streamed(client, d0, ASK, ids, 3)
        assert len(made) == 2
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert without_call_ids(accumulated(events)) == without_call_ids(whole)


async def test_without_a_reasoning_parser_think_tags_are_text(model_dir, tok):
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    async with serving(model_dir) as (client, d0):
        whole = await message(client, d0, ASK, ids_of(tok, text), 4)
    assert whole["content"] == [{"type": "text", "text": text}]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_sequences_and_max_tokens(model_dir, tok, stream):
    """A stop sequence ends the answer where it appears (the worker is told to stop) and is
    the response's stop_sequence; the length limit is max_tokens."""

    async def ask(body, ids, finish):
        if stream:
            return accumulated(await streamed(client, d0, body, ids, 2, finish))
        return await message(client, d0, body, ids, 2, finish)

    ids = ids_of(tok, "Sunny today. END of it")
    async with serving(model_dir) as (client, d0):
        stopped = await ask({**ASK, "stop_sequences": ["\n\n", "END"]}, ids, None)
        assert d0.cancels == [d0.received[-1].bus_id]  # the worker stops generating it
        cut = await ask(ASK, ids_of(tok, "Sunny"), "length")
    assert stopped["content"] == [{"type": "text", "text": "Sunny today. "}]
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("max_tokens", None)


async def test_the_worker_gets_the_chat_endpoints_prompt_and_sampling(model_dir, tok):
    """One conversion core: a Messages request with tools, a call, its result and a named tool
    choice reaches the worker as the chat request of the same conversation does - the same
    prompt tokens, the same sampling parameters and grammar (the seed aside: each request
    without one gets its own)."""
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}],
        },
    ]
    chat_turns = [
        turns[0],
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
    ]
    function = {
        "name": "get_weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    }
    body = {
        **ASK,
        "system": "Be brief.",
        "messages": turns,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "temperature": 0.7,
        "top_k": 20,
        "stop_sequences": ["END"],
    }
    chat = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "system", "content": "Be brief."}, *chat_turns],
        "tools": [{"type": "function", "function": function}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0.7,
        "top_k": 20,
        "stop": ["END"],
    }
    ids = ids_of(tok, CALL)
    async with serving(model_dir) as (client, d0):
        whole = await message(client, d0, body, ids, 5)
        mine = d0.received[-1]
        reply = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
        theirs = await d0.next_request()
        await d0.tokens(theirs, ids, "stop")
        assert (await asyncio.wait_for(reply, 10)).status == 200
        conversation = ("model", "system", "messages", "tools", "tool_choice")
        count_body = {k: body[k] for k in conversation}
        count = await client.post("/v1/messages/count_tokens", json=count_body)
        counted = (await count.json())["input_tokens"]
    assert mine.prompt_token_ids == theirs.prompt_token_ids
    assert counted == len(mine.prompt_token_ids)
    assert mine.sampling.guided is not None
    assert dataclasses.replace(mine.sampling, seed=0) == dataclasses.replace(
        theirs.sampling, seed=0
    )
    assert [b["type"] for b in whole["content"]] == ["tool_use"]


async def test_a_last_assistant_message_is_continued(model_dir, tok):
    body = {
        **ASK,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "It is"},
        ],
    }
    async with serving(model_dir) as (client, d0):
        whole = await message(client, d0, body, ids_of(tok, " sunny."), 2)
        prompt = tok.decode(d0.received[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("It is")  # the reply's turn is left open, not closed
    assert whole["content"] == [{"type": "text", "text": " sunny."}]


async def test_the_anthropic_sdk_reads_the_answers(model_dir, tok):
    """Anthropic's own SDK (a test dependency; perf/compat/anthropic_sdk.py runs it against
    `pdserve up` as users do) parses the message, the event stream and a tool_use as the whole
    message has them."""
    ids = ids_of(tok, f"Let me check.\n{CALL}")
    async with serving(model_dir) as (client, d0):
        api = anthropic.AsyncAnthropic(
            base_url=str(client.make_url("")), api_key="none", max_retries=0
        )

        async def worker() -> None:
            request = await d0.next_request()
            for i in range(0, len(ids), 3):
                await d0.tokens(request, ids[i : i + 3], "stop" if i + 3 >= len(ids) else None)

        body = dict(model=MODEL, max_tokens=64, messages=ASK["messages"], tools=[WEATHER])
        whole, _ = await asyncio.gather(api.messages.create(**body), worker())

        async def stream():
            async with api.messages.stream(**body) as events:
                kinds = [event.type async for event in events]
                return kinds, await events.get_final_message()

        (kinds, final), _ = await asyncio.gather(stream(), worker())
        await api.close()
    for got in (whole, final):
        assert got.stop_reason == "tool_use"
        assert [b.type for b in got.content] == ["text", "tool_use"]
        assert got.content[0].text == "Let me check."
        assert (got.content[1].name, got.content[1].input) == ("get_weather", {"city": "Paris"})
    assert final.usage.output_tokens == whole.usage.output_tokens == len(ids)
    assert "input_json" in kinds and kinds[-1] == "message_stop"
