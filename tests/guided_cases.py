"""Structured-output cases for property tests (in-process engines and real stacks alike): guides
of every kind, and the check that an output obeys its guide. An output that finished with "stop"
must parse and validate; one cut by max_tokens ("length") must be a prefix its grammar accepts,
which llguidance checks token by token.

``REPRO`` is issue 26's reproduction: SmolLM2-135M-Instruct, this chat message and schema, seed
12, max_tokens 60. Its draw for output token 42 had a uniform noise of exactly 1.0 on token 15345
(" hash", refused by the grammar), which the sampler picked.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from pdserve.shared.sampling import GuidedDecoding
from pdserve.shared.structured_output import GrammarCompiler

REPRO_MESSAGE = 'what is 1+1? The format is "result": 2'
REPRO_SCHEMA = {"type": "object", "properties": {"result": {"type": "integer"}}}
REPRO = dict(seed=12, max_tokens=60, message=REPRO_MESSAGE, schema=REPRO_SCHEMA)
REPRO_BAD_TOKEN, REPRO_BAD_POSITION = 15345, 42  # " hash", the 43rd output token

SCHEMAS: dict[str, dict[str, Any]] = {
    # no "required", other keys allowed: the schema
    "open_object": REPRO_SCHEMA,
    "required_object": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -5, "maximum": 250},
            "kind": {"enum": ["cat", "dog", "fox"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    "integer": {"type": "integer", "minimum": -40, "maximum": 4000},
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 3,
    },
    "nested": {  # an object in an object, an array of enums
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 99},
                    "y": {"type": "boolean"},
                },
                "required": ["x"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["point"],
        "additionalProperties": False,
    },
}
REGEX = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "lazy dog", 'say "hi"']

GUIDES: dict[str, GuidedDecoding] = {
    **{name: GuidedDecoding("json_schema", json.dumps(s)) for name, s in SCHEMAS.items()},
    "regex": GuidedDecoding("regex", REGEX),
    "choice": GuidedDecoding("choice", json.dumps(CHOICES)),
}


def request_fields(name: str) -> dict[str, Any]:
    """The OpenAI request fields that ask for guide ``name``."""
    if name in SCHEMAS:
        schema = {"name": name, "schema": SCHEMAS[name]}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    if name == "regex":
        return {"guided_regex": REGEX}
    return {"guided_choice": CHOICES}


# checked once, here: jsonschema.validate would check the schema itself on every call
VALIDATORS = {name: jsonschema.validators.validator_for(s)(s) for name, s in SCHEMAS.items()}


def assert_finished_valid(name: str, text: str) -> None:
    """A "stop" output: the whole of what its guide describes."""
    if name in SCHEMAS:
        VALIDATORS[name].validate(json.loads(text))
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def assert_tokens_obey(
    compiler: GrammarCompiler, name: str, tokens: list[int], finish_reason: str
) -> None:
    """Every sampled token (before a final EOS) is one the grammar allows, in order; a "stop"
    output ends in an accepting state, a "length" one anywhere."""
    matcher = compiler.new_matcher(GUIDES[name])
    body = tokens
    if finish_reason == "stop":
        assert tokens and tokens[-1] in compiler.eos_token_ids, tokens
        body = tokens[:-1]
    assert finish_reason in ("stop", "length"), finish_reason
    taken = matcher.try_consume_tokens(body)
    assert taken == len(body), f"{name}: token {body[taken]} at {taken} refused: {tokens}"
    if finish_reason == "stop":
        assert matcher.is_accepting(), f"{name}: stopped before its grammar was done: {tokens}"


def assert_text_obeys(compiler: GrammarCompiler, name: str, text: str, finish_reason: str) -> None:
    """What a client sees: a "stop" text validates, a "length" text is a prefix of a valid one."""
    if finish_reason == "stop":
        assert_finished_valid(name, text)
        return
    assert finish_reason == "length", finish_reason
    tokens = compiler.tokenizer.tokenize_str(text)
    taken = compiler.new_matcher(GUIDES[name]).try_consume_tokens(tokens)
    assert taken == len(tokens), f"{name}: {text!r} is no prefix its grammar accepts"
