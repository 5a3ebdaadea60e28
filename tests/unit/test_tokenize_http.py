"""``POST /tokenize`` and ``POST /detokenize`` through the real app (HTTP, the in-memory bus),
on a tiny tokenizer trained offline: vLLM's shapes, a conversation tokenized exactly as the
chat endpoint sends it to the workers, every answer valid by its model and the published
schema, bad input as the OpenAI error shape (400, 404 for an unknown model), and the requests
counted by endpoint in /metrics. The real SmolLM2 tokenizer against transformers:
``tests/integration/test_tokenize_smollm2.py``."""

from __future__ import annotations

import asyncio
import functools

import jsonschema
import pytest

from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.tokenize_bodies import DetokenizeResponse, TokenizeResponse
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüße aus München! 😀"},
]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@functools.cache
def _published(path: str, status: str) -> jsonschema.Draft202012Validator:
    document = openapi_spec(MODEL)
    response = document["paths"][path]["post"]["responses"][status]
    return jsonschema.Draft202012Validator(
        {**response["content"]["application/json"]["schema"], **document}
    )


def _request_valid(path: str, body: dict) -> bool:
    document = openapi_spec(MODEL)
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return jsonschema.Draft202012Validator({**schema["schema"], **document}).is_valid(body)


async def post(client, path: str, body: dict) -> tuple[int, dict]:
    response = await client.post(path, json=body)
    payload = await response.json()
    _published(path, str(response.status)).validate(payload)
    if response.status == 200:
        model = TokenizeResponse if path == "/tokenize" else DetokenizeResponse
        model.model_validate(payload, strict=True)
    return response.status, payload


async def test_text_is_tokenized_as_a_prompt(model_dir, tok):
    async with serving(model_dir) as (client, _):
        text = "Grüße aus München! 😀 naïve"
        status, body = await post(client, "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200
        ids = tok.encode(text).ids  # special tokens added (BOS), as completions does
        models = await (await client.get("/v1/models")).json()
        served = models["data"][0]["max_model_len"]  # the decode worker's KV caps the context
        assert body == {
            "count": len(ids),
            "max_model_len": served,
            "tokens": ids,
            "token_strs": None,
        }
        _, plain = await post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})
        assert plain["tokens"] == tok.encode(text, add_special_tokens=False).ids == ids[1:]
        _, strs = await post(client, "/tokenize", {"prompt": "Hello", "return_token_strs": True})
        assert strs["token_strs"] == [tok.id_to_token(i) for i in strs["tokens"]]
        assert strs["token_strs"][0] == "<s>"
        _, empty = await post(client, "/tokenize", {"prompt": "", "add_special_tokens": False})
        assert (empty["count"], empty["tokens"]) == (0, [])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_generation_prompt": False},
        {
            "continue_final_message": True,
            "messages": [*CHAT, {"role": "assistant", "content": "Hallo"}],
        },
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"tools": [WEATHER], "tool_choice": "none"},  # the fallback prompt lists them
    ],
)
async def test_a_conversation_is_the_chat_endpoints_prompt(model_dir, options):
    """The ids the chat endpoint sends the workers for the same messages and options."""
    body = {"model": MODEL, "messages": CHAT, **options}
    async with serving(model_dir) as (client, d0):
        status, tokenized = await post(client, "/tokenize", body)
        assert status == 200
        reply = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        request = await d0.next_request()
        await d0.tokens(request, [], "stop")
        await reply
    assert tokenized["tokens"] == request.prompt_token_ids
    assert tokenized["count"] == len(request.prompt_token_ids)


async def test_special_tokens_on_top_of_the_template_only_when_asked(model_dir, tok):
    async with serving(model_dir) as (client, _):
        _, plain = await post(client, "/tokenize", {"messages": CHAT})
        _, added = await post(client, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
    assert added["tokens"] == [tok.token_to_id("<s>"), *plain["tokens"]]


async def test_detokenize_is_the_inverse(model_dir, tok):
    async with serving(model_dir) as (client, _):
        text = "Emoji: 😀 🚀 and ∑ ∞"
        _, tokens = await post(client, "/tokenize", {"prompt": text})
        status, body = await post(
            client, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}
        )
        assert status == 200
        assert body == {"prompt": "<s>" + text}  # special tokens kept, as vLLM decodes
        assert (await post(client, "/detokenize", {"tokens": []}))[1] == {"prompt": ""}


BAD = [
    # (path, body, status, param, code)
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "messages", "invalid_value"),
    ("/tokenize", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": None, "messages": None}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": 1}, 400, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt", "invalid_type"),
    (
        "/tokenize",
        {"prompt": "x", "add_special_tokens": "yes"},
        400,
        "add_special_tokens",
        "invalid_type",
    ),
    (
        "/tokenize",
        {"prompt": "x", "return_token_strs": 1},
        400,
        "return_token_strs",
        "invalid_type",
    ),
    (
        "/tokenize",
        {"prompt": "x", "add_generation_prompt": True},
        400,
        "add_generation_prompt",
        "unsupported_parameter",
    ),  # a chat field with text
    (
        "/tokenize",
        {"prompt": "x", "chat_template": "{{ 1 }}"},
        400,
        "chat_template",
        "unsupported_parameter",
    ),
    ("/tokenize", {"messages": []}, 400, "messages", "invalid_value"),
    (
        "/tokenize",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "/tokenize",
        {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
        400,
        "continue_final_message",
        "invalid_value",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}]},
        400,
        "messages[0].tool_call_id",
        "invalid_value",
    ),
    (
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
        "invalid_value",
    ),
    ("/detokenize", {"tokens": [300]}, 400, "tokens", "invalid_token_id"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "invalid_value"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]", "invalid_type"),
    ("/detokenize", {"tokens": 5}, 400, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]", "invalid_type"),
    ("/detokenize", {}, 400, "tokens", "missing_required_parameter"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt", "unsupported_parameter"),
]


async def test_bad_input_is_an_openai_error(model_dir):
    async with serving(model_dir) as (client, _):
        for path, body, status, param, code in BAD:
            got, payload = await post(client, path, body)
            error = payload["error"]
            assert (got, error["param"], error["code"]) == (status, param, code), (body, payload)
            assert error["type"] == "invalid_request_error" and error["message"]
            if code in ("invalid_type", "unsupported_parameter"):
                assert not _request_valid(path, body), body  # the schema says so too
        response = await client.post("/tokenize", data=b"{not json")
        assert response.status == 400 and (await response.json())["error"]["param"] is None


async def test_a_model_without_a_chat_template(tmp_path, tok):
    bare = write_model_dir(tmp_path / MODEL, train_byte_level(300), template=None)
    async with serving(bare) as (client, _):
        status, payload = await post(client, "/tokenize", {"messages": CHAT})
        assert (status, payload["error"]["param"]) == (400, "messages")
        assert (await post(client, "/tokenize", {"prompt": "Hi"}))[0] == 200


async def test_requests_are_counted_by_endpoint(model_dir):
    async with serving(model_dir) as (client, _):
        await post(client, "/tokenize", {"prompt": "Hi"})
        await post(client, "/tokenize", {"prompt": "Hi"})
        await post(client, "/tokenize", {"prompt": 1})
        await post(client, "/detokenize", {"tokens": [1]})
        await client.get("/v1/models/other")
        await client.get("/nowhere")
        text = await (await client.get("/metrics")).text()
    lines = {line for line in text.splitlines() if line.startswith("pdserve_http_requests_total")}
    assert {
        'pdserve_http_requests_total{endpoint="/tokenize",status="200"} 2.0',
        'pdserve_http_requests_total{endpoint="/tokenize",status="400"} 1.0',
        'pdserve_http_requests_total{endpoint="/detokenize",status="200"} 1.0',
        'pdserve_http_requests_total{endpoint="/v1/models/{model}",status="404"} 1.0',
        'pdserve_http_requests_total{endpoint="unmatched",status="404"} 1.0',
    } <= lines
