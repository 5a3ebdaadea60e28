"""Issue 16's request fields through the pydantic request models: every accepted value lands in
``GenerationParams`` (or ``CompletionRequest.prompts``), every bad one is one OpenAI-shaped 400
naming the field. (``/openapi.json`` and a fuzz run: test_openapi_schema.py.)"""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.api_models import parse_chat, parse_completion
from pdserve.gateway.errors import APIError
from pdserve.shared.sampling import (
    MAX_GUIDED_SPEC_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    GuidedDecoding,
)

COMPLETION = {"model": "m", "prompt": "hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_SPEC = json.dumps(SCHEMA)
TOO_LONG = "x" * (MAX_GUIDED_SPEC_CHARS + 1)


def error_of(parse, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.type == "invalid_request_error"
    return err


# ----------------------------------------------------------------------------- accepted

# Structured output is the same on both endpoints.
GUIDED_ACCEPTED = [
    ({"response_format": {"type": "text"}}, {"guided": None}),
    ({"response_format": {"type": "json_object"}}, {"guided": GuidedDecoding("json_object")}),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a-1", "schema": SCHEMA},
            }
        },
        {"guided": GuidedDecoding("json_schema", SCHEMA_SPEC)},
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True, "description": "d"},
            }
        },
        {"guided": GuidedDecoding("json_schema", SCHEMA_SPEC)},
    ),
    ({"guided_json": SCHEMA}, {"guided": GuidedDecoding("json_schema", SCHEMA_SPEC)}),
    ({"guided_json": json.dumps(SCHEMA)}, {"guided": GuidedDecoding("json_schema", SCHEMA_SPEC)}),
    ({"guided_regex": r"\d{3}"}, {"guided": GuidedDecoding("regex", r"\d{3}")}),
    ({"guided_choice": ["yes", "no"]}, {"guided": GuidedDecoding("choice", '["yes", "no"]')}),
    # "text" constrains nothing, so it does not count against the one guide allowed
    (
        {"response_format": {"type": "text"}, "guided_regex": "a+"},
        {"guided": GuidedDecoding("regex", "a+")},
    ),
    ({"response_format": None, "guided_json": None, "guided_choice": None}, {"guided": None}),
]
COMMON_ACCEPTED = [
    ({"n": MAX_N}, {"n": MAX_N}),
    (
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    ),
    (
        {"repetition_penalty": MAX_REPETITION_PENALTY},
        {"repetition_penalty": MAX_REPETITION_PENALTY},
    ),
    ({"repetition_penalty": 0.5}, {"repetition_penalty": 0.5}),
    (
        {"logit_bias": {"50256": -100, "0": 100, "7": 0.5}},
        {"logit_bias": {50256: -100.0, 0: 100.0, 7: 0.5}},
    ),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}}, {}),
    ({"stop_token_ids": [0, 2, 2]}, {"stop_token_ids": [0, 2, 2]}),
    ({"stop_token_ids": [1] * MAX_STOP_TOKEN_IDS}, {}),
    ({"max_tokens": 5, "min_tokens": 5}, {"min_tokens": 5}),
    ({"min_tokens": 0}, {"min_tokens": 0}),
    *GUIDED_ACCEPTED,
]
COMPLETION_ACCEPTED = [
    ({"n": 2, "best_of": 5}, {"n": 2, "best_of": 5}),
    ({"n": 3, "best_of": 3, "stream": True}, {"n": 3, "best_of": 3, "stream": True}),
    ({"logprobs": 0}, {"logprobs": 0}),
    ({"logprobs": MAX_LOGPROBS, "echo": True}, {"logprobs": MAX_LOGPROBS, "echo": True}),
    # lm-eval's loglikelihood: the prompt's log-probs, nothing generated
    (
        {"max_tokens": 0, "echo": True, "logprobs": 1},
        {"max_tokens": 0, "echo": True, "logprobs": 1},
    ),
    ({"min_tokens": 16}, {"min_tokens": 16, "max_tokens": 16}),  # the default max_tokens
    ({"echo": False, "logprobs": None}, {"echo": False, "logprobs": None}),
    *COMMON_ACCEPTED,
]
CHAT_ACCEPTED = [
    ({"logprobs": True}, {"logprobs": 0}),
    ({"logprobs": True, "top_logprobs": MAX_LOGPROBS}, {"logprobs": MAX_LOGPROBS}),
    ({"logprobs": False}, {"logprobs": None}),
    ({"logprobs": True, "top_logprobs": 0}, {"logprobs": 0}),
    ({"max_completion_tokens": 8, "min_tokens": 8}, {"max_tokens": 8, "min_tokens": 8}),
    ({"min_tokens": 100}, {"min_tokens": 100, "max_tokens": None}),  # capped by the context later
    *COMMON_ACCEPTED,
]


def check_params(params, expected: dict) -> None:
    for name, value in expected.items():
        got = getattr(params, name)
        assert got == value and type(got) is type(value), (name, got, value)


@pytest.mark.parametrize("patch, expected", COMPLETION_ACCEPTED)
def test_completion_fields_land_in_generation_params(patch, expected):
    check_params(parse_completion({**COMPLETION, **patch}).params, expected)


@pytest.mark.parametrize("patch, expected", CHAT_ACCEPTED)
def test_chat_fields_land_in_generation_params(patch, expected):
    check_params(parse_chat({**CHAT, **patch}).params, expected)


def test_defaults_change_nothing():
    for params in (parse_completion(COMPLETION).params, parse_chat(CHAT).params):
        check_params(
            params,
            {
                "n": 1,
                "best_of": None,
                "logprobs": None,
                "echo": False,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "repetition_penalty": 1.0,
                "min_tokens": 0,
                "logit_bias": {},
                "stop_token_ids": [],
                "guided": None,
            },
        )


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("a", ["a"]),
        ([1, 2], [[1, 2]]),
        (["a", "b c"], ["a", "b c"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        ([[4, 5]], [[4, 5]]),
        (["p"] * 64, ["p"] * 64),
    ],
)
def test_prompts_keep_their_order(prompt, prompts):
    req = parse_completion({**COMPLETION, "prompt": prompt})
    assert req.prompts == prompts
    assert req.prompt == prompts[0]


def test_choices_per_request_are_bounded():
    parse_completion({**COMPLETION, "prompt": ["p"] * 64, "n": 2})  # 128 choices
    assert error_of(parse_completion, {**COMPLETION, "prompt": ["p"] * 64, "n": 3}).param == "n"
    body = {**COMPLETION, "prompt": [[1]] * 43, "n": 1, "best_of": 3}  # 129 sampled
    assert error_of(parse_completion, body).param == "best_of"


# ----------------------------------------------------------------------------- refused

BIG_SCHEMA = {"enum": ["x" * 1000] * (MAX_GUIDED_SPEC_CHARS // 1000 + 1)}
GUIDED_BAD = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
        "response_format.json_schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {}, "strict": 1},
            }
        },
        "response_format.json_schema.strict",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {}, "x": 1},
            }
        },
        "response_format.json_schema.x",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BIG_SCHEMA},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": []}, "guided_json"),
    ({"guided_json": "[]"}, "guided_json"),
    ({"guided_json": "{"}, "guided_json"),
    ({"guided_json": '{"a": NaN}'}, "guided_json"),
    ({"guided_json": '{"a":' * 40 + "1" + "}" * 40}, "guided_json"),
    ({"guided_json": TOO_LONG}, "guided_json"),
    ({"guided_json": BIG_SCHEMA}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": TOO_LONG}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["yes", ""]}, "guided_choice[1]"),
    ({"guided_choice": ["yes", 1]}, "guided_choice[1]"),
    ({"guided_choice": [TOO_LONG[:-2]]}, "guided_choice"),  # fits, but not as a JSON list
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
]
COMMON_BAD = [
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": "2"}, "n"),
    ({"n": True}, "n"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": "0"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": MAX_REPETITION_PENALTY + 0.5}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"logit_bias": []}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {" 1": 1}}, "logit_bias"),
    ({"logit_bias": {"2147483648": 1}}, "logit_bias"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"1": MAX_LOGIT_BIAS_VALUE + 1}}, "logit_bias"),
    ({"logit_bias": {"1": -MAX_LOGIT_BIAS_VALUE - 0.5}}, "logit_bias"),
    ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"logit_bias": {"1": "2"}}, "logit_bias"),
    ({"logit_bias": {"1": None}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"stop_token_ids": 1}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
    ({"stop_token_ids": [1, 2.5]}, "stop_token_ids[1]"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids[1]"),
    ({"stop_token_ids": [0] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    *GUIDED_BAD,
]
COMPLETION_BAD = [
    ({"best_of": 0}, "best_of"),
    ({"best_of": MAX_N + 1}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),  # OpenAI refuses it: the best are known at the end
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo": 1}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # the default max_tokens is 16
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt": ["p"] * 65}, "prompt"),
    ({"prompt": [[1]] * 65}, "prompt"),
    ({"prompt": [[]]}, "prompt[0]"),
    ({"prompt": [["a"]]}, "prompt[0][0]"),
    ({"prompt": [[1], [2, -3]]}, "prompt[1][1]"),
    ({"prompt": [1, [2]]}, "prompt[1]"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": [[1], "a"]}, "prompt[1]"),
    ({"prompt": [{"a": 1}]}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),  # chat's field
    *COMMON_BAD,
]
CHAT_BAD = [
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": "true"}, "logprobs"),
    ({"top_logprobs": MAX_LOGPROBS + 1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"best_of": 2}, "best_of"),  # completions' field
    ({"echo": "yes"}, "echo"),  # chat echo is vLLM's, and a boolean
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    *COMMON_BAD,
]


def check_refused(parse, body, param) -> APIError:
    err = error_of(parse, body)
    assert err.param == param, err.body()
    assert param.split(".")[0].split("[")[0] in err.message
    return err


@pytest.mark.parametrize("patch, param", COMPLETION_BAD)
def test_completion_refuses_bad_values_naming_the_field(patch, param):
    check_refused(parse_completion, {**COMPLETION, **patch}, param)


@pytest.mark.parametrize("patch, param", CHAT_BAD)
def test_chat_refuses_bad_values_naming_the_field(patch, param):
    check_refused(parse_chat, {**CHAT, **patch}, param)


def test_error_codes_and_messages():
    def err(parse, body):
        return error_of(parse, body).body()["error"]

    assert err(parse_chat, {**CHAT, "tools": [{"type": "function"}]}) == {
        "message": "'tools[0].function' is required",
        "type": "invalid_request_error",
        "param": "tools[0].function",
        "code": "missing_required_parameter",
    }
    # An unsupported top-level parameter is reported before other errors.
    body = {**COMPLETION, "n": 99, "suffix": "x"}
    assert err(parse_completion, body)["code"] == "unsupported_parameter"
    assert err(parse_completion, {**COMPLETION, "n": "2"})["code"] == "invalid_type"
    assert err(parse_completion, {**COMPLETION, "n": 0})["message"] == "'n' must be >= 1"
    bias = err(parse_completion, {**COMPLETION, "logit_bias": {"abc": 1}})
    assert "'abc'" in bias["message"] and bias["code"] == "invalid_value"
    missing = err(parse_completion, {**COMPLETION, "response_format": {"type": "json_schema"}})
    assert missing["code"] == "missing_required_parameter"
    both = err(parse_completion, {**COMPLETION, "guided_regex": "a", "guided_choice": ["a"]})
    assert "guided_regex" in both["message"]  # says what it clashes with
