"""Request validation: every bad input is an OpenAI-shaped 4xx naming what is wrong."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.api_models import (
    check_length,
    check_token_ids,
    parse_chat,
    parse_completion,
)
from pdserve.gateway.errors import APIError
from pdserve.gateway.schema_base import parse_json_body


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    err = info.value
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert 400 <= err.status < 500
    return err


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"   ",
        b"{",
        b"[1, 2]",
        b'"text"',
        b"null",
        b"\xff\xfe{}",
        b'{"model": "m\xc3"}',
        b'{"temperature": NaN}',
        b'{"temperature": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 40 + b"1" + b"}" * 40,
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "a\\ud800b"}',
        b'{"messages": [{"\\udfff": 1}]}',
    ],
)
def test_bad_bodies(raw):
    err = error_of(parse_json_body, raw)
    assert err.status == 400


def test_good_body():
    # A surrogate pair escape is one real character, unlike a lone half.
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}
    assert parse_json_body('{"model": "m", "prompt": "é"}'.encode()) == {
        "model": "m",
        "prompt": "é",
    }


BASE = {"model": "m", "prompt": "hello"}


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"model": None}, "model"),
        ({"model": 3}, "model"),
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt[1]"),
        ({"prompt": [1, True]}, "prompt[1]"),
        ({"prompt": [1, -1]}, "prompt[1]"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": [[1], ["a"]]}, "prompt[1][0]"),
        ({"prompt": [None]}, "prompt"),
        ({"prompt": {"x": 1}}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"seed": 2**70}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stop": 5}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ["a", 3]}, "stop[1]"),
        ({"stop": ["x" * 257]}, "stop[0]"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"other": 1}}, "stream_options.other"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"messages": []}, "messages"),
    ],
)
def test_completion_field_errors(patch, param):
    body = {**BASE, **patch}
    err = error_of(parse_completion, body)
    assert err.status == 400
    assert err.param == param
    assert param.split(".")[0].split("[")[0] in err.message


def test_completion_defaults_and_values():
    req = parse_completion({**BASE, "logprobs": None})
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, -1, None)
    req = parse_completion(
        {
            "model": "m",
            "prompt": [[1, 2, 3]],
            "max_tokens": 8.0,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 0,
            "seed": 7,
            "stop": "\n",
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u",
        }
    )
    assert req.prompt == [1, 2, 3]
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (8, 0.0, 0.5, -1, 7)
    assert p.stop == ["\n"] and p.ignore_eos and p.stream and p.include_usage


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "messages, param",
    [
        ("hi", "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
        ),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ],
)
def test_chat_message_errors(messages, param):
    err = error_of(parse_chat, {**CHAT, "messages": messages})
    assert err.param == param


def test_chat_values():
    req = parse_chat(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be nice"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 5,
        }
    )
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "be nice"),
        ("user", "ab"),
        ("assistant", ""),
    ]
    assert req.params.max_tokens == 5
    assert parse_chat(CHAT).params.max_tokens is None
    err = error_of(parse_chat, {**CHAT, "max_tokens": 3, "max_completion_tokens": 4})
    assert err.param == "max_completion_tokens"
    assert error_of(parse_completion, {**BASE, "max_completion_tokens": 3}).param == (
        "max_completion_tokens"
    )


def test_lengths_and_vocab():
    assert check_length(10, None, 64, 0) == 54
    assert check_length(10, 54, 64, 0) == 54
    assert error_of(check_length, 10, 55, 64, 0).param == "max_tokens"
    assert error_of(check_length, 64, None, 64, 0).code == "context_length_exceeded"
    assert error_of(check_length, 20, 1, 64, 16).param == "prompt"
    check_token_ids([0, 99], 100)
    assert error_of(check_token_ids, [0, 100], 100).param == "prompt"
    assert error_of(check_token_ids, [-1], 100).param == "prompt"


def test_error_body_is_json_serialisable():
    err = error_of(parse_completion, {**BASE, "suffix": "x"})
    assert json.loads(json.dumps(err.body()))["error"]["param"] == "suffix"
