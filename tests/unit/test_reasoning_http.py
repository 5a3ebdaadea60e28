"""``--reasoning-parser`` through the real app (HTTP, the in-memory bus, a scripted decode
worker that sends the tokens of what a reasoning model wrote): the whole answer's
``reasoning_content`` and ``content``, the streamed ``reasoning_content`` and ``content``
deltas joined to exactly the whole answer however the tokens are grouped into events (the
tiny tokenizer cuts ``<think>`` and ``</think>`` into several tokens, so the tags straddle
events), tool calls read from the content only, and where the answer starts read off the
rendered prompt."""

from __future__ import annotations

import pytest

from pdserve.gateway.response_models import ChatCompletion, ChatCompletionChunk
from tests.unit.conftest import ids_of
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving
from tests.unit.test_tool_calls_http import WEATHER, answered, valid

ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
THOUGHT = "The user wants the weather.\nI could write <tool_call> here, but not yet."
ANSWER = f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny in Paris."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def rebuilt(events: list[dict]) -> tuple[str | None, str | None, list[str], str | None]:
    """What a client rebuilds from a stream: reasoning, content, the called functions' names
    and the finish reason (each chunk valid as published)."""
    reasoning, content, names, finish = "", "", [], None
    for event in events:
        valid(ChatCompletionChunk, event, "text/event-stream")
        for choice in event["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            names += [c["function"]["name"] for c in delta.get("tool_calls", []) if "id" in c]
            finish = choice["finish_reason"] or finish
    return reasoning or None, content or None, names, finish


async def both(client, d0, body: dict, ids: list[int], per_event: int):
    """The whole answer's message and finish reason, and the stream's rebuilt."""
    whole = await answered(client, d0, body, ids, per_event)
    valid(ChatCompletion, whole, "application/json")
    events = await answered(client, d0, {**body, "stream": True}, ids, per_event)
    (choice,) = whole["choices"]
    return choice["message"], choice["finish_reason"], rebuilt(events)


@pytest.mark.parametrize("per_event", [1, 2, 3, 5, 1000])
async def test_qwen3_reasoning_is_split_out(model_dir, tok, per_event):
    async with serving(model_dir, reasoning_parser="qwen3") as (client, d0):
        message, finish, streamed = await both(client, d0, ASK, ids_of(tok, ANSWER), per_event)
    assert message == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "reasoning_content": THOUGHT,
    }
    assert streamed == (THOUGHT, "It is sunny in Paris.", [], "stop") and finish == "stop"


async def test_qwen3_without_tags_is_all_content_and_thinking_off_too(model_dir, tok):
    async with serving(model_dir, reasoning_parser="qwen3") as (client, d0):
        message, _, streamed = await both(client, d0, ASK, ids_of(tok, "Sunny."), 2)
        assert message == {"role": "assistant", "content": "Sunny.", "reasoning_content": None}
        assert streamed[:2] == (None, "Sunny.")
        off = {**ASK, "chat_template_kwargs": {"enable_thinking": False}}
        message, _, streamed = await both(client, d0, off, ids_of(tok, ANSWER), 2)
    assert (message["content"], message["reasoning_content"]) == (ANSWER, None)
    assert streamed[:2] == (None, ANSWER)


@pytest.mark.parametrize("per_event", [1, 4])
async def test_deepseek_r1_starts_inside_the_reasoning(model_dir, tok, per_event):
    """R1's answer may hold only the closing tag (its template wrote the opening one); cut off
    by max_tokens before it, the whole answer is reasoning and content is null."""
    text = f"{THOUGHT}\n</think>\n\nSunny."
    async with serving(model_dir, reasoning_parser="deepseek_r1") as (client, d0):
        message, _, streamed = await both(client, d0, ASK, ids_of(tok, text), per_event)
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, "Sunny.")
        assert streamed[:2] == (THOUGHT, "Sunny.")
        cut = ids_of(tok, "Still thinking about")
        whole = await answered(client, d0, ASK, cut, per_event, finish="length")
        events = await answered(client, d0, {**ASK, "stream": True}, cut, per_event, "length")
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Still thinking about", None)
    assert rebuilt(events) == ("Still thinking about", None, [], "length")


@pytest.mark.parametrize("per_event", [1, 3, 1000])
async def test_tool_calls_are_read_from_the_content_only(model_dir, tok, per_event):
    """A <tool_call> the model only thinks about is reasoning, not a call."""
    text = f"<think>{THOUGHT}</think>\nLet me check.\n{CALL}"
    body = {**ASK, "tools": [WEATHER]}
    async with serving(model_dir, reasoning_parser="qwen3") as (client, d0):
        message, finish, streamed = await both(client, d0, body, ids_of(tok, text), per_event)
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, "Let me check.")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert finish == "tool_calls"
    assert streamed == (THOUGHT, "Let me check.", ["get_weather"], "tool_calls")


async def test_the_prompt_says_where_the_answer_starts(thinking_dir, tok):
    """A template that opens <think> in the prompt: the answer starts inside the reasoning,
    even under qwen3; with enable_thinking false it closed it there: all content."""
    text = f"{THOUGHT}</think>Sunny."
    async with serving(thinking_dir, reasoning_parser="qwen3") as (client, d0):
        message, _, streamed = await both(client, d0, ASK, ids_of(tok, text), 2)
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, "Sunny.")
        assert streamed[:2] == (THOUGHT, "Sunny.")
        off = {**ASK, "chat_template_kwargs": {"enable_thinking": False}}
        message, _, _ = await both(client, d0, off, ids_of(tok, "Sunny."), 2)
        assert (message["reasoning_content"], message["content"]) == (None, "Sunny.")


async def test_without_a_parser_nothing_changes(model_dir, tok):
    async with serving(model_dir) as (client, d0):
        message, _, streamed = await both(client, d0, ASK, ids_of(tok, ANSWER), 3)
    assert message == {"role": "assistant", "content": ANSWER}
    assert streamed[:2] == (None, ANSWER)


async def test_a_reply_sent_back_with_its_reasoning(thinking_dir):
    """Agents send the assistant's message back whole: its reasoning_content is taken, and
    given to the template, which may show it; on another role it is a 400."""
    reply = {"role": "assistant", "content": "Sunny.", "reasoning_content": THOUGHT}
    history = [*ASK["messages"], reply, {"role": "user", "content": "And Rome?"}]
    async with serving(thinking_dir, reasoning_parser="qwen3") as (client, _):
        tokenized = await client.post("/tokenize", json={"messages": history})
        ids = (await tokenized.json())["tokens"]
        text = await client.post("/detokenize", json={"tokens": ids})
        assert f"<think>{THOUGHT}</think>Sunny." in (await text.json())["prompt"]
        wrong = [{**ASK["messages"][0], "reasoning_content": "x"}]
        refused = await client.post("/v1/chat/completions", json={**ASK, "messages": wrong})
        error = (await refused.json())["error"]
    assert (refused.status, error["param"]) == (400, "messages[0].reasoning_content")


async def test_structured_output_starts_after_the_reasoning(thinking_dir, model_dir, tok):
    """A response format under a reasoning parser reaches the workers held back until the
    thoughts end, as the prompt says they start (inside; optional under qwen3 when the prompt
    opened nothing; none when the template closed them); the JSON comes back as content."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    form = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = {**ASK, "response_format": form}
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    async with serving(thinking_dir, reasoning_parser="qwen3") as (client, d0):
        message, _, _ = await both(client, d0, body, ids_of(tok, f'{THOUGHT}</think>{{"a": 1}}'), 2)
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, '{"a": 1}')
        await both(client, d0, off, ids_of(tok, '{"a": 1}'), 2)
        starts = [r.sampling.guided.reasoning for r in d0.received]
    assert starts == ["inside"] * 2 + [""] * 2  # each answered whole, then streamed
    async with serving(model_dir, reasoning_parser="qwen3") as (client, d0):
        await both(client, d0, body, ids_of(tok, '{"a": 1}'), 2)
        tagged = [r.sampling.guided.reasoning for r in d0.received]
    async with serving(model_dir) as (client, d0):
        await both(client, d0, body, ids_of(tok, '{"a": 1}'), 2)
        plain = [r.sampling.guided.reasoning for r in d0.received]
    assert (tagged, plain) == (["tag"] * 2, [""] * 2)
