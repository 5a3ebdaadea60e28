"""Issue 16, item 6: usage in streams, the fields accepted because they change nothing, the SSE
line breaks, and ``/openapi.json`` in step with all of them. (Through a real gateway and the
``openai`` client: tests/integration/test_gateway_usage.py.)"""

from __future__ import annotations

import json

import httpx2
import jsonschema
import pytest
from httpx2._decoders import LineDecoder

from pdserve.gateway.api_models import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    GenerationParams,
    parse_chat,
    parse_completion,
)
from pdserve.gateway.errors import APIError
from pdserve.gateway.generation import Generation, Progress, Prompt
from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.streaming import Chunks, encode_event

COMPLETION = {"model": "m", "prompt": "hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
NEUTRAL_CHAT = {
    "user": "someone",
    "metadata": {"team": "eval", "run": "x" * 512, "k" * 64: ""},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
}
NEUTRAL_COMPLETION = {
    k: NEUTRAL_CHAT[k] for k in ("user", "frequency_penalty", "presence_penalty", "logit_bias")
}
# Every line break str.splitlines knows; httpx's line reader splits on all of them.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def error_of(fn, body) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body)
    assert info.value.status == 400
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    return info.value


# ----------------------------------------------------------------------------- neutral fields


def test_neutral_fields_are_accepted_and_change_nothing():
    plain = parse_chat(CHAT).params
    assert parse_chat({**CHAT, **NEUTRAL_CHAT}).params == plain
    assert parse_chat({**CHAT, "store": True, "service_tier": "flex"}).params == plain
    assert parse_chat({**CHAT, **dict.fromkeys(NEUTRAL_CHAT)}).params == plain  # null = absent
    plain = parse_completion(COMPLETION).params
    assert parse_completion({**COMPLETION, **NEUTRAL_COMPLETION}).params == plain
    assert parse_completion({**COMPLETION, "frequency_penalty": -0.0}).params == plain


@pytest.mark.parametrize(
    "patch, param, code",
    [
        ({"user": 5}, "user", "invalid_type"),
        ({"metadata": "x"}, "metadata", "invalid_type"),
        ({"metadata": ["a"]}, "metadata", "invalid_type"),
        ({"metadata": {"a": 1}}, "metadata", "invalid_type"),
        ({"metadata": {"a": None}}, "metadata", "invalid_type"),
        ({"metadata": {"a": "v" * 513}}, "metadata", "invalid_value"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"store": "yes"}, "store", "invalid_type"),
        ({"store": 1}, "store", "invalid_type"),
        ({"service_tier": 3}, "service_tier", "invalid_value"),
        ({"service_tier": "gold"}, "service_tier", "invalid_value"),
        ({"parallel_tool_calls": "true"}, "parallel_tool_calls", "invalid_type"),
        ({"frequency_penalty": "0"}, "frequency_penalty", "invalid_type"),
        ({"frequency_penalty": True}, "frequency_penalty", "invalid_type"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
        ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
        ({"logit_bias": []}, "logit_bias", "invalid_type"),
        ({"logit_bias": "{}"}, "logit_bias", "invalid_type"),
    ],
)
def test_neutral_fields_are_type_checked(patch, param, code):
    err = error_of(parse_chat, {**CHAT, **patch})
    assert (err.param, err.code) == (param, code)
    assert param in err.message
    if param not in ("metadata", "store", "service_tier", "parallel_tool_calls"):
        err = error_of(parse_completion, {**COMPLETION, **patch})
        assert (err.param, err.code) == (param, code)


@pytest.mark.parametrize("name", ["metadata", "store", "service_tier", "parallel_tool_calls"])
def test_chat_only_fields_are_refused_on_completions(name):
    err = error_of(parse_completion, {**COMPLETION, name: NEUTRAL_CHAT[name]})
    assert (err.param, err.code) == (name, "unsupported_parameter")


def test_bad_tools_are_named_with_parallel_tool_calls():
    err = error_of(parse_chat, {**CHAT, "parallel_tool_calls": False, "tools": [{}]})
    assert err.param == "tools[0].type"


# ----------------------------------------------------------------------------- stream_options


def test_stream_options():
    def params(options) -> GenerationParams:
        return parse_chat({**CHAT, "stream": True, "stream_options": options}).params

    p = params({"include_usage": True, "continuous_usage_stats": True})
    assert (p.include_usage, p.continuous_usage) == (True, True)
    p = params({"include_usage": True, "continuous_usage_stats": False})
    assert (p.include_usage, p.continuous_usage) == (True, False)
    # As in vLLM, continuous usage rides on include_usage; alone it does nothing.
    p = params({"continuous_usage_stats": True})
    assert (p.include_usage, p.continuous_usage) == (False, False)
    p = params({"include_usage": None, "continuous_usage_stats": None})
    assert (p.include_usage, p.continuous_usage) == (False, False)
    for bad, param in [
        ({"continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats"),
        (
            {"include_usage": True, "continuous_usage_stats": 1},
            "stream_options.continuous_usage_stats",
        ),
        ({"include_usage": "true"}, "stream_options.include_usage"),
        ({"other": True}, "stream_options.other"),
        ([True], "stream_options"),
    ]:
        assert error_of(parse_chat, {**CHAT, "stream": True, "stream_options": bad}).param == param
    body = {**COMPLETION, "stream_options": {"continuous_usage_stats": True}}
    assert error_of(parse_completion, body).param == "stream_options"  # stream is not true


def chunks_for(chat: bool, **usage_options) -> Chunks:
    params = GenerationParams(model="m", max_tokens=8, stream=True, **usage_options)
    progress = Progress(prompt_tokens=5)
    # The chunks read only the operation, params, id and progress: no gateway, no sampling.
    operation = "chat" if chat else "text_completion"
    prompts = [Prompt([1] * 5, "")]
    gen = Generation(None, operation, params, prompts, [], "r", progress)  # type: ignore[arg-type]
    return Chunks(gen)


@pytest.mark.parametrize("chat", [True, False])
def test_chunk_usage(chat):
    assert "usage" not in chunks_for(chat)("a", None)
    chunks = chunks_for(chat, include_usage=True)
    chunks.gen.progress.completion_tokens = 3
    assert chunks("a", None)["usage"] is None  # OpenAI's null on every content chunk
    assert chunks(None, "length")["usage"] is None
    last = chunks.usage_chunk()
    assert last["choices"] == []
    assert last["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert last["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    chunks = chunks_for(chat, include_usage=True, continuous_usage=True)
    chunks.gen.progress.completion_tokens = 2
    running = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert chunks("a", None)["usage"] == running  # vLLM's shape, counted so far
    assert chunks(None, "stop")["usage"] == running


# ----------------------------------------------------------------------------- SSE lines


def lines_of(stream: bytes) -> list[str]:
    """The lines httpx's own reader (``Response.iter_lines``) makes of ``stream``."""
    decoder = LineDecoder()
    return decoder.decode(stream.decode("utf-8")) + decoder.flush()


@pytest.mark.parametrize("char", list(LINE_BREAKS))
def test_sse_data_lines_survive_every_line_break_in_the_text(char):
    payload = {"choices": [{"text": f"a{char}b{char}", "delta": {"content": char}}]}
    event = encode_event(payload)
    lines = lines_of(event)
    assert lines == [lines[0], ""], lines  # one data line, then the blank line ending the event
    assert lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == payload
    assert event.decode("utf-8").splitlines() == lines


def test_sse_keeps_other_text_as_utf8():
    event = encode_event({"text": "Grüße 😀 日本語"})
    assert "Grüße 😀 日本語".encode() in event


async def test_httpx_reads_the_stream_split_anywhere():
    """Through httpx's own ``aiter_lines`` over a streamed body cut into 1-byte pieces."""
    text = "x\u2028y\u2029z\x85 é"
    body = b"".join(encode_event({"n": i, "text": text}) for i in range(3)) + b"data: [DONE]\n\n"

    async def pieces():
        for i in range(len(body)):
            yield body[i : i + 1]

    response = httpx2.Response(200, content=pieces())
    events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:]) for e in events[:-1]] == [{"n": i, "text": text} for i in range(3)]


# ----------------------------------------------------------------------------- /openapi.json


def test_openapi_lists_exactly_what_is_accepted():
    schemas = openapi_spec("m")["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= CHAT_KEYS
    assert set(chat["properties"]) == CHAT_KEYS
    assert set(completion["properties"]) == COMPLETION_KEYS
    assert chat["properties"]["stream_options"]["anyOf"][0] == {
        "$ref": "#/components/schemas/StreamOptions"
    }
    assert set(schemas["StreamOptions"]["properties"]) == {
        "include_usage",
        "continuous_usage_stats",
    }


def request_validator(name: str) -> jsonschema.Draft202012Validator:
    """A JSON Schema validator for one request body of ``/openapi.json``, its $refs resolved
    within the document."""
    components = openapi_spec("m")["components"]
    schema = {"$ref": f"#/components/schemas/{name}", "components": components}
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(
    "patch",
    [
        NEUTRAL_CHAT,
        {"store": True, "service_tier": None, "metadata": None},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"frequency_penalty": 0.5},
        {"presence_penalty": "0"},
        {"logit_bias": {"1": 2}},
        {"metadata": {"a": 1}},
        {"metadata": {str(i): "v" for i in range(17)}},
        {"store": "no"},
        {"service_tier": "gold"},
        {"parallel_tool_calls": 0},
        {"stream": True, "stream_options": {"continuous_usage_stats": "x"}},
        {"stream": True, "stream_options": {"other": True}},
    ],
)
def test_openapi_schema_agrees_with_the_validator(patch):
    body = {**CHAT, **patch}
    try:
        parse_chat(body)
        accepted = True
    except APIError:
        accepted = False
    assert request_validator("ChatCompletionRequest").is_valid(body) == accepted
