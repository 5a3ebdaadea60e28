"""Issue 16, item 6 through a real gateway over HTTP (the scripted workers of
test_gateway_http.py behind it): usage in streams as OpenAI sends it and vLLM's
continuous_usage_stats, read with the official ``openai`` client; the fields accepted because
they change nothing; and U+2028, U+2029 and U+0085 in the generated text read back with httpx's
own line iterator (guidellm's reader), which splits lines on them."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from tests.integration import test_gateway_http as http_tests
from tests.integration.test_gateway_http import CHAT, COMPLETION, MODEL, Harness

# The HTTP tests' fixtures (a nats-server, the tiny model, a gateway with a scripted worker).
nats_url, model_dir, tokenizer = http_tests.nats_url, http_tests.model_dir, http_tests.tokenizer
gw = http_tests.gw

# Generated text with every line break that JSON does not escape by itself.
BREAKING_TEXT = "one\u2028two\u2029three\x85four é\u2028"
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "user": "u-1"}
NEUTRAL_CHAT = {
    **NEUTRAL,
    "metadata": {"suite": "compat"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": False,
}


def client_for(harness: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.base + "/v1", api_key="unused", max_retries=0)


def text_of(chunk, chat: bool) -> str:
    choice = chunk.choices[0]
    return (choice.delta.content or "") if chat else choice.text


@pytest.mark.parametrize("chat", [False, True])
async def test_include_usage_is_a_last_chunk_without_choices(gw: Harness, tokenizer, chat):
    client = client_for(gw)
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": CHAT["messages"]} if chat else {"prompt": COMPLETION["prompt"]}
    stream = await create(
        model=MODEL, max_tokens=6, stream=True, stream_options={"include_usage": True}, **prompt
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)  # "usage": null on every other chunk
    prompt_tokens = len(gw.worker.requests[-1].prompt_token_ids)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 6)
    assert last.usage.total_tokens == prompt_tokens + 6
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert "".join(text_of(c, chat) for c in content) == tokenizer.decode(gw.worker.script[:6])


@pytest.mark.parametrize("chat", [False, True])
async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(gw: Harness, chat):
    client = client_for(gw)
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": CHAT["messages"]} if chat else {"prompt": COMPLETION["prompt"]}
    stream = await create(
        model=MODEL, max_tokens=8, stream=True, stream_options=CONTINUOUS, **prompt
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    prompt_tokens = len(gw.worker.requests[-1].prompt_token_ids)
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    counts = [c.usage.completion_tokens for c in content]
    assert all(c.usage.prompt_tokens == prompt_tokens for c in content)
    assert all(
        c.usage.total_tokens == prompt_tokens + n for c, n in zip(content, counts, strict=True)
    )
    assert counts == sorted(counts) and counts[-1] == 8
    if chat:
        assert content[0].choices[0].delta.role == "assistant" and counts[0] == 0
    # The scripted worker sends one token per event: each content chunk counts one more.
    text_counts = [n for c, n in zip(content, counts, strict=True) if text_of(c, chat)]
    assert text_counts == list(range(1, len(text_counts) + 1))


async def test_continuous_usage_shape_is_vllms(gw: Harness):
    """On the wire: exactly vLLM's three counts on each chunk, the full usage on the last."""
    body = {**COMPLETION, "stream": True, "stream_options": CONTINUOUS}
    status, events, _ = await gw.stream("/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    *chunks, final = events[:-1]
    assert all(
        set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"} for c in chunks
    )
    assert set(final["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    # Alone, continuous_usage_stats changes nothing, as in vLLM: no usage key, no usage chunk.
    body["stream_options"] = {"continuous_usage_stats": True}
    status, events, _ = await gw.stream("/v1/completions", body)
    assert status == 200 and all("usage" not in e and e["choices"] for e in events[:-1])


@pytest.mark.parametrize("chat", [False, True])
async def test_neutral_fields_are_accepted_through_the_openai_client(gw: Harness, tokenizer, chat):
    client = client_for(gw)
    if chat:
        reply = await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=4, **NEUTRAL_CHAT
        )
        text = reply.choices[0].message.content
    else:
        reply = await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, **NEUTRAL
        )
        text = reply.choices[0].text
    assert text == tokenizer.decode(gw.worker.script[:4])
    sent = gw.worker.requests[-1].sampling
    assert sent.max_tokens == 4
    # The penalties and logit_bias are real parameters now: out of bounds, a 400 naming them.
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"logit_bias": {"5": 101}}):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, **bad)
        (param,) = bad
        assert info.value.status_code == 400
        assert info.value.body["param"] == param and info.value.body["code"] == "invalid_value"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=4, metadata={"a": 1}
        )
    assert info.value.body["param"] == "metadata"
    await client.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_line_separators_in_the_text_survive_httpx_line_reader(gw: Harness, tokenizer, path):
    gw.worker.script = tokenizer.encode(BREAKING_TEXT, add_special_tokens=False)
    assert tokenizer.decode(gw.worker.script) == BREAKING_TEXT
    chat = path.endswith("chat/completions")
    body = {**(CHAT if chat else COMPLETION), "max_tokens": len(gw.worker.script)}
    body.update(stream=True, stream_options=CONTINUOUS)
    events = []
    async with httpx2.AsyncClient() as http:
        async with http.stream("POST", gw.base + path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():  # what guidellm reads streams with
                assert not line or line.startswith("data: "), line
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    pieces = [c["choices"][0] for c in events[:-1] if c["choices"]]
    text = "".join((p["delta"].get("content") or "") if chat else p["text"] for p in pieces)
    assert text == BREAKING_TEXT
    # The openai client reads the same stream to the same text.
    client = client_for(gw)
    kwargs = {"messages": CHAT["messages"]} if chat else {"prompt": "Hello"}
    create = client.chat.completions.create if chat else client.completions.create
    stream = await create(model=MODEL, max_tokens=body["max_tokens"], stream=True, **kwargs)
    assert "".join([text_of(c, chat) async for c in stream]) == BREAKING_TEXT
    await client.close()
