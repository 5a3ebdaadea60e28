"""``/openapi.json``'s request schemas, generated from the pydantic request models: the issue 16
fields with their bounds, tool calling's fields, and a fuzz run checking that every body
gets either a valid request or one 400 naming a field, and that nothing the validator accepts
is invalid by the published schema."""

from __future__ import annotations

import functools

import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.gateway.api_models import CHAT_KEYS, COMPLETION_KEYS, parse_chat, parse_completion
from pdserve.gateway.errors import APIError
from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.tools.request import FUNCTION_NAME, MAX_TOOLS
from pdserve.shared.sampling import (
    MAX_GUIDED_SPEC_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
)
from tests.unit.test_api_schemas import CHAT, CHAT_ACCEPTED, COMPLETION, COMPLETION_ACCEPTED


@functools.cache
def request_validator(name: str) -> jsonschema.Draft202012Validator:
    components = openapi_spec("m")["components"]
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": components}
    )


def test_openapi_documents_the_new_fields_and_bounds():
    schemas = openapi_spec("m")["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for props in (completion, chat):
        assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, MAX_N)
        assert (props["presence_penalty"]["minimum"], props["presence_penalty"]["maximum"]) == (
            -2,
            2,
        )
        assert props["repetition_penalty"]["exclusiveMinimum"] == 0
        assert props["repetition_penalty"]["maximum"] == MAX_REPETITION_PENALTY
        assert props["min_tokens"]["minimum"] == 0
        bias = props["logit_bias"]
        assert bias["maxProperties"] == MAX_LOGIT_BIAS
        assert bias["additionalProperties"]["maximum"] == MAX_LOGIT_BIAS_VALUE
        assert bias["propertyNames"] == {"pattern": "^[0-9]+$"}
        assert props["stop_token_ids"]["maxItems"] == MAX_STOP_TOKEN_IDS
        assert props["guided_regex"]["maxLength"] == MAX_GUIDED_SPEC_CHARS
        assert props["guided_choice"]["minItems"] == 1
        assert {"$ref": "#/components/schemas/ResponseFormat"} in props["response_format"]["anyOf"]
    assert completion["logprobs"]["maximum"] == MAX_LOGPROBS
    assert completion["best_of"]["maximum"] == MAX_N
    assert (
        completion["max_tokens"]["minimum"] == 0
        and "echo" in completion["max_tokens"]["description"]
    )
    assert completion["echo"]["type"] == ["boolean", "null"]
    assert len(completion["prompt"]["anyOf"]) == 4
    assert chat["logprobs"]["type"] == ["boolean", "null"]
    assert chat["top_logprobs"]["maximum"] == MAX_LOGPROBS
    assert chat["max_tokens"]["minimum"] == 1
    assert chat["tools"]["maxItems"] == MAX_TOOLS
    assert chat["tools"]["items"] == {"$ref": "#/components/schemas/Tool"}
    assert schemas["FunctionDefinition"]["properties"]["name"]["pattern"] == FUNCTION_NAME
    assert {"$ref": "#/components/schemas/NamedToolChoice"} in chat["tool_choice"]["anyOf"]
    assert {"enum": ["none", "auto", "required"], "type": "string"} in chat["tool_choice"]["anyOf"]
    chat_doc = " ".join(schemas["ChatCompletionRequest"]["description"].split())
    assert "enforce the calls' format and arguments with a grammar" in chat_doc
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == [
        "text",
        "json_object",
        "json_schema",
    ]
    assert schemas["JsonSchemaFormat"]["required"] == ["name", "schema"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert schemas[name]["additionalProperties"] == {"type": "null"}  # others only as null
        request_validator(name)  # every $ref resolves


@pytest.mark.parametrize("patch", [p for p, _ in COMPLETION_ACCEPTED])
def test_openapi_accepts_the_completions_the_validator_accepts(patch):
    assert request_validator("CompletionRequest").is_valid({**COMPLETION, **patch})


@pytest.mark.parametrize("patch", [p for p, _ in CHAT_ACCEPTED])
def test_openapi_accepts_the_chats_the_validator_accepts(patch):
    assert request_validator("ChatCompletionRequest").is_valid({**CHAT, **patch})


# ----------------------------------------------------------------------------- fuzz

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
# Each field mostly valid, sometimes just out of bounds or of the wrong type.
common_fields = {
    "n": st.integers(0, 17),
    "max_tokens": st.integers(0, 40),
    "min_tokens": st.integers(-1, 20),
    "temperature": st.floats(0, 2.1),
    "presence_penalty": st.floats(-2.1, 2),
    "repetition_penalty": st.floats(0, 10.5) | st.booleans(),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "7", "50256", "x", "-1", "99999999999"]),
        st.floats(-100, 101) | st.booleans(),
        max_size=3,
    ),
    "stop_token_ids": st.lists(st.integers(-1, 10), max_size=3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
        optional={
            "json_schema": st.fixed_dictionaries(
                {"name": st.sampled_from(["a", "a b"]), "schema": st.just({}) | json_values}
            )
        },
    ),
    "guided_json": st.sampled_from([{"type": "object"}, "{}", "[]", "{", 3]),
    "guided_regex": st.text(max_size=3),
    "guided_choice": st.lists(st.text(max_size=2), max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
completion_fields = {
    **common_fields,
    "best_of": st.integers(0, 17),
    "logprobs": st.integers(-1, 21) | st.booleans(),
    "echo": st.booleans(),
    "prompt": st.one_of(
        st.text(max_size=4),
        st.lists(st.integers(-1, 9), max_size=3),
        st.lists(st.text(max_size=3), max_size=3),
        st.lists(st.lists(st.integers(0, 9), max_size=2), max_size=3),
    ),
}
chat_fields = {
    **common_fields,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "max_completion_tokens": st.integers(0, 40),
    "metadata": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
}
field_names = st.sampled_from(sorted(CHAT_KEYS | COMPLETION_KEYS | {"tools", "suffix"}))
anything = st.one_of(st.just({}), st.dictionaries(field_names, json_values, max_size=2))


def bodies(base: dict, fields: dict) -> st.SearchStrategy[dict]:
    return st.builds(
        lambda known, extra: {**base, **known, **extra},
        st.fixed_dictionaries({}, optional=fields),
        anything,
    )


def check(parse, name: str, required: tuple[str, ...], body: dict) -> None:
    try:
        parse(body)
    except APIError as err:
        assert err.status == 400
        assert err.param is not None
        root = err.param.split(".")[0].split("[")[0]
        assert root in body or root in required, (err.param, body)
        event(f"400 {err.code}")
        return
    event("accepted")
    # Whatever the validator accepts, the published schema accepts too.
    assert request_validator(name).is_valid(body), body


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(body=bodies(COMPLETION, completion_fields))
def test_fuzz_completions(body):
    check(parse_completion, "CompletionRequest", ("model", "prompt"), body)


@FUZZ
@given(body=bodies(CHAT, chat_fields))
def test_fuzz_chat(body):
    check(parse_chat, "ChatCompletionRequest", ("model", "messages"), body)
