"""vLLM's request extensions through the pydantic request models (``gateway/vllm_fields.py``,
``gateway/guided_fields.py``): what each accepted value becomes, the one 400 naming
the field for every bad one, and ``/openapi.json`` documenting them. (Over real HTTP:
test_vllm_extensions_http.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.gateway.api_models import parse_chat, parse_completion
from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.vllm_fields import TEMPLATE_KWARGS_MAX_CHARS, TEMPLATE_KWARGS_MAX_KEYS
from pdserve.shared.sampling import MAX_LOGPROBS, GuidedDecoding
from tests.unit.test_api_schemas import CHAT, COMPLETION, SCHEMA, error_of

GBNF = 'root ::= "yes" | "no"'
# A schema vLLM's disable_additional_properties closes: the top object and the nested one (with
# patternProperties); the one that says otherwise keeps its word.
OPEN = {
    "type": "object",
    "properties": {
        "a": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        "b": {"type": "object", "properties": {}, "additionalProperties": True},
    },
}
CLOSED = {
    **OPEN,
    "properties": {
        "a": {**OPEN["properties"]["a"], "additionalProperties": False},
        "b": OPEN["properties"]["b"],
    },
    "additionalProperties": False,
}

STRUCTURED_ACCEPTED = [
    ({"json": SCHEMA}, GuidedDecoding("json_schema", json.dumps(SCHEMA))),
    ({"json": json.dumps(SCHEMA)}, GuidedDecoding("json_schema", json.dumps(SCHEMA))),
    ({"regex": r"\d+"}, GuidedDecoding("regex", r"\d+")),
    ({"choice": ["a", "b"]}, GuidedDecoding("choice", '["a", "b"]')),
    ({"grammar": GBNF}, GuidedDecoding("grammar", GBNF)),
    ({"grammar": 'start: "a"+'}, GuidedDecoding("grammar", 'start: "a"+')),
    ({"json_object": True}, GuidedDecoding("json_object")),
    ({"json_object": False, "regex": "a"}, GuidedDecoding("regex", "a")),  # false: no constraint
    (
        {"json": OPEN, "disable_additional_properties": True},
        GuidedDecoding("json_schema", json.dumps(CLOSED)),
    ),
    (
        {"json": OPEN, "disable_additional_properties": False},
        GuidedDecoding("json_schema", json.dumps(OPEN)),
    ),
    (
        {"regex": "a", "disable_any_whitespace": False, "structural_tag": None},
        GuidedDecoding("regex", "a"),
    ),
]


@pytest.mark.parametrize("parse, base", [(parse_completion, COMPLETION), (parse_chat, CHAT)])
@pytest.mark.parametrize("value, guided", STRUCTURED_ACCEPTED)
def test_structured_outputs_become_the_one_guide(parse, base, value, guided):
    params = parse({**base, "structured_outputs": value}).params
    assert params.guided == guided
    key = next(k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k))
    assert params.guided_param == f"structured_outputs.{key}"  # where a compile error points


STRUCTURED_BAD = [
    ({}, "structured_outputs", "missing_required_parameter"),
    ({"json_object": False}, "structured_outputs", "missing_required_parameter"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs.choice", "invalid_value"),
    ({"json": SCHEMA, "grammar": GBNF}, "structured_outputs.grammar", "invalid_value"),
    ({"json": "[1]"}, "structured_outputs.json", "invalid_value"),
    ({"json": 3}, "structured_outputs.json", "invalid_type"),
    ({"regex": ""}, "structured_outputs.regex", "invalid_value"),
    ({"choice": []}, "structured_outputs.choice", "invalid_value"),
    ({"grammar": 7}, "structured_outputs.grammar", "invalid_type"),
    (
        {"regex": "a", "structural_tag": "{}"},
        "structured_outputs.structural_tag",
        "unsupported_parameter",
    ),
    (
        {"regex": "a", "disable_any_whitespace": True},
        "structured_outputs.disable_any_whitespace",
        "unsupported_parameter",
    ),
    (
        {"regex": "a", "whitespace_pattern": " "},
        "structured_outputs.whitespace_pattern",
        "unsupported_parameter",
    ),
    ({"regex": "a", "backend": "xgrammar"}, "structured_outputs.backend", "unsupported_parameter"),
]


@pytest.mark.parametrize("value, param, code", STRUCTURED_BAD)
def test_structured_outputs_refusals_name_the_key(value, param, code):
    for parse, base in [(parse_completion, COMPLETION), (parse_chat, CHAT)]:
        err = error_of(parse, {**base, "structured_outputs": value})
        assert (err.param, err.code) == (param, code), err.body()


@pytest.mark.parametrize(
    "other", [{"guided_regex": "a"}, {"response_format": {"type": "json_object"}}]
)
def test_structured_outputs_is_one_guide_among_the_others(other):
    err = error_of(parse_completion, {**COMPLETION, **other, "structured_outputs": {"regex": "b"}})
    assert err.param == "structured_outputs" and next(iter(other)) in err.message
    # "text" constrains nothing, as with the other guides
    body = {**COMPLETION, "response_format": {"type": "text"}, "structured_outputs": {"regex": "b"}}
    assert parse_completion(body).params.guided == GuidedDecoding("regex", "b")


# ----------------------------------------------------------------------------- the others


@pytest.mark.parametrize("parse, base", [(parse_completion, COMPLETION), (parse_chat, CHAT)])
def test_shared_extensions_land_in_generation_params(parse, base):
    params = parse(base).params
    assert (params.prompt_logprobs, params.return_token_ids, params.truncate_prompt_tokens) == (
        None,
        False,
        None,
    )
    body = {
        **base,
        "prompt_logprobs": MAX_LOGPROBS,
        "return_token_ids": True,
        "truncate_prompt_tokens": -1,
    }
    params = parse(body).params
    assert (params.prompt_logprobs, params.return_token_ids, params.truncate_prompt_tokens) == (
        MAX_LOGPROBS,
        True,
        -1,
    )
    assert (
        parse({**base, "prompt_logprobs": 0, "truncate_prompt_tokens": 7}).params.prompt_logprobs
        == 0
    )
    # As in vLLM a stream carries no prompt log-probs: 0 is allowed there, and not computed.
    assert parse({**base, "prompt_logprobs": 0, "stream": True}).params.prompt_logprobs is None


SHARED_BAD = [
    ({"prompt_logprobs": -1}, "prompt_logprobs", "every token of the vocabulary"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs", f"<= {MAX_LOGPROBS}"),
    ({"prompt_logprobs": True}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ({"return_token_ids": 1}, "return_token_ids", "boolean"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ">= -1"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens", "integer"),
]


@pytest.mark.parametrize("patch, param, phrase", SHARED_BAD)
def test_shared_extensions_refuse_bad_values(patch, param, phrase):
    for parse, base in [(parse_completion, COMPLETION), (parse_chat, CHAT)]:
        err = error_of(parse, {**base, **patch})
        assert err.param == param and phrase in err.message, err.body()


TWO_TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]


@pytest.mark.parametrize(
    "patch, template, role, echo",
    [
        ({}, (True, False, {}), "assistant", ""),
        ({"echo": True}, (True, False, {}), "assistant", "Once"),  # the assistant's own turn
        ({"echo": True, "continue_final_message": True}, (False, True, {}), "assistant", "Once"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            (False, True, {}),
            "assistant",
            "",
        ),
        (
            {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
            (False, False, {"enable_thinking": False}),
            "assistant",
            "",
        ),
    ],
)
def test_chat_rendering_options(patch, template, role, echo):
    req = parse_chat({**CHAT, "messages": TWO_TURNS, **patch})
    assert (req.add_generation_prompt, req.continue_final_message, req.template_kwargs) == template
    assert (req.params.reply_role, req.params.chat_echo) == (role, echo)


def test_without_a_generation_prompt_the_reply_has_the_last_role():
    req = parse_chat({**CHAT, "add_generation_prompt": False, "echo": True})
    assert (req.params.reply_role, req.params.chat_echo) == ("user", "hi")
    # with a generation prompt the reply is the assistant's: a user message is not echoed
    req = parse_chat({**CHAT, "echo": True})
    assert (req.params.reply_role, req.params.chat_echo) == ("assistant", "")


CHAT_BAD = [
    (
        {"continue_final_message": True, "add_generation_prompt": True},
        "continue_final_message",
        "add_generation_prompt",
    ),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "boolean"),
    ({"echo": 1}, "echo", "boolean"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs", "object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
    (
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs",
        "set by the server",
    ),
    ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", "'a-b'"),
    (
        {"chat_template_kwargs": {f"k{i}": 1 for i in range(TEMPLATE_KWARGS_MAX_KEYS + 1)}},
        "chat_template_kwargs",
        f"at most {TEMPLATE_KWARGS_MAX_KEYS} entries",
    ),
    (
        {"chat_template_kwargs": {"k": "x" * TEMPLATE_KWARGS_MAX_CHARS}},
        "chat_template_kwargs",
        f"{TEMPLATE_KWARGS_MAX_CHARS} characters",
    ),
]


@pytest.mark.parametrize("patch, param, phrase", CHAT_BAD)
def test_chat_extensions_refuse_bad_values(patch, param, phrase):
    err = error_of(parse_chat, {**CHAT, **patch})
    assert err.param == param and phrase in err.message, err.body()


@pytest.mark.parametrize(
    "name, value",
    [
        ("add_generation_prompt", True),
        ("continue_final_message", False),
        ("chat_template_kwargs", {}),
        ("top_logprobs", 1),
    ],
)
def test_chat_only_extensions_are_refused_on_completions(name, value):
    err = error_of(parse_completion, {**COMPLETION, name: value})
    assert (err.param, err.code) == (name, "unsupported_parameter")


# ----------------------------------------------------------------------------- /openapi.json


def test_openapi_documents_the_extensions():
    schemas = openapi_spec("m")["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for props in (completion, chat):
        assert (props["prompt_logprobs"]["minimum"], props["prompt_logprobs"]["maximum"]) == (
            0,
            MAX_LOGPROBS,
        )
        assert props["return_token_ids"]["type"] == ["boolean", "null"]
        assert props["truncate_prompt_tokens"]["minimum"] == -1
        assert {"$ref": "#/components/schemas/StructuredOutputs"} in props["structured_outputs"][
            "anyOf"
        ]
    for name in ("echo", "add_generation_prompt", "continue_final_message"):
        assert chat[name]["type"] == ["boolean", "null"]
    assert chat["chat_template_kwargs"]["maxProperties"] == TEMPLATE_KWARGS_MAX_KEYS
    assert "add_generation_prompt" not in completion
    structured = schemas["StructuredOutputs"]["properties"]
    assert {"json", "regex", "choice", "grammar", "json_object"} <= set(structured)
    for refused in ("structural_tag", "whitespace_pattern"):
        assert structured[refused]["type"] == "null"
        assert "not supported" in structured[refused]["description"]
    # the response fields, present only when asked
    for model, fields in [
        ("CompletionChoice", {"prompt_logprobs", "prompt_token_ids", "token_ids"}),
        ("CompletionChunkChoice", {"prompt_token_ids", "token_ids"}),
        ("ChatCompletionResponse", {"prompt_logprobs", "prompt_token_ids"}),
        ("ChatChoice", {"token_ids"}),
        ("ChatChunkChoice", {"token_ids"}),
        ("ChatCompletionChunk", {"prompt_token_ids"}),
    ]:
        assert fields <= set(schemas[model]["properties"]), model
        assert not fields & set(schemas[model].get("required", [])), model
    assert set(schemas["PromptLogprob"]["required"]) == {"logprob", "rank", "decoded_token"}


@pytest.mark.parametrize(
    "name, body",
    [
        (
            "CompletionRequest",
            {
                **COMPLETION,
                "prompt_logprobs": 2,
                "return_token_ids": True,
                "truncate_prompt_tokens": -1,
                "structured_outputs": {"grammar": GBNF},
            },
        ),
        (
            "ChatCompletionRequest",
            {
                **CHAT,
                "echo": True,
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template_kwargs": {"enable_thinking": False},
                "structured_outputs": {"json": SCHEMA, "disable_additional_properties": True},
            },
        ),
    ],
)
def test_openapi_accepts_what_the_validator_accepts(name, body):
    (parse_completion if name == "CompletionRequest" else parse_chat)(body)
    components = openapi_spec("m")["components"]
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": components}
    )
    validator.validate(body)
    assert not validator.is_valid({**body, "truncate_prompt_tokens": -2})
