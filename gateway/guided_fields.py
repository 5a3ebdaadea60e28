"""Structured output's request fields, in OpenAI's and vLLM's spellings, read into one
``pdserve.shared.sampling.GuidedDecoding``. The value types of the specs are shared by every
spelling, so each spec is checked the same way whichever field carries it.

vLLM's ``structured_outputs`` object, its current name for the ``guided_*`` fields, is read into
the same one ``GuidedDecoding``, the only guide of a request.

Exactly one constraint: ``json`` (a schema, or a string holding one), ``regex``, ``choice``,
``grammar`` (Lark, or GBNF as llama.cpp and vLLM's xgrammar backend write it; llguidance reads
both, as vLLM's guidance backend does) or ``json_object: true``. Of the options,
``disable_additional_properties`` is honoured as vLLM does it: a schema object that lists
``properties`` or ``patternProperties`` and says nothing of ``additionalProperties`` gets
``false``. The rest are refused with a 400 naming them, rather than accepted and not honoured:

- ``structural_tag``: vLLM takes two incompatible formats (the legacy ``triggers`` /
  ``structures`` one and xgrammar's nested ``format`` one); llguidance has no reading of the
  second, and its tags treat ``<...>`` triggers as special tokens by guesswork.
- ``disable_any_whitespace: true`` and ``whitespace_pattern``: pdserve's JSON grammar has one
  whitespace rule (at most ``JSON_MAX_WHITESPACE`` characters between tokens), so compact or
  custom whitespace cannot be promised.

The fields: OpenAI's ``response_format`` and vLLM's ``guided_json``, ``guided_regex``,
``guided_choice`` and ``structured_outputs``, read into one
``pdserve.shared.sampling.GuidedDecoding``.

- ``{"type": "text"}``: no constraint.
- ``{"type": "json_object"}``: any JSON object (kind ``json_object``).
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`` and
  ``guided_json`` (a schema object, or a string holding one): kind ``json_schema``, the spec is
  ``json.dumps(schema)``.
- ``guided_regex``: kind ``regex``; ``guided_choice`` (non-empty strings): kind ``choice``, the
  spec is ``json.dumps`` of the list.
- ``structured_outputs`` (vLLM's current spelling, above): the same
  kinds, and ``grammar`` (Lark or GBNF).

At most one of them may constrain a request. Only their shape is checked here (a schema is an
object, a spec is at most ``MAX_GUIDED_SPEC_CHARS``); whether a grammar compiles is checked where
it is compiled.
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.schema_base import (
    INVALID_VALUE,
    MISSING,
    UNSUPPORTED,
    StrictModel,
    field_error,
    loads_bounded,
    refused,
    shaped,
)
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS, GuidedDecoding
from pdserve.shared.structured_output import JSON_MAX_WHITESPACE


def _schema_from_text(text: str) -> dict[str, Any]:
    try:
        value = loads_bounded(text)
    except ValueError as exc:
        raise PydanticCustomError(
            INVALID_VALUE, "as a JSON string {why}", {"why": str(exc)}
        ) from None
    if not isinstance(value, dict):
        raise PydanticCustomError(INVALID_VALUE, "must hold a JSON object (a schema)")
    return value


SchemaObject = dict[str, Any]


SchemaText = Annotated[
    str, Field(max_length=MAX_GUIDED_SPEC_CHARS), AfterValidator(_schema_from_text)
]


GuidedJson = Annotated[
    Any,
    shaped(
        SchemaObject,
        SchemaText,
        pick=lambda v: 0 if isinstance(v, dict) else 1 if isinstance(v, str) else None,
        otherwise="must be a JSON schema: an object, or a string holding one",
    ),
]


Regex = Annotated[str, Field(min_length=1, max_length=MAX_GUIDED_SPEC_CHARS)]


Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


Grammar = Annotated[str, Field(min_length=1, max_length=MAX_GUIDED_SPEC_CHARS)]


Guide = tuple[str, str, tuple[str, ...]]  # (kind, spec, where the spec came from)


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def _only_false(value: bool) -> bool:
    if value:
        raise PydanticCustomError(
            UNSUPPORTED,
            "JSON output may hold up to {n} whitespace characters between tokens; compact JSON "
            "is not enforced",
            {"n": JSON_MAX_WHITESPACE},
        )
    return value


def no_additional_properties(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``disable_additional_properties``: ``schema`` (a copy) with
    ``"additionalProperties": false`` on every object that has ``properties`` or
    ``patternProperties`` and does not say otherwise."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
            if "additionalProperties" not in node and (
                "properties" in node or "patternProperties" in node
            ):
                node["additionalProperties"] = False
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(schema)
    return schema


class StructuredOutputs(StrictModel):
    """vLLM's structured output: exactly one of json, regex, choice, grammar or json_object."""

    json_: GuidedJson | None = Field(
        None,
        alias="json",
        description="output follows this JSON schema (an object, or a string holding one)",
    )
    regex: Regex | None = Field(None, description="output matches this regular expression")
    choice: Choices | None = Field(None, description="output is exactly one of these strings")
    grammar: Grammar | None = Field(
        None, description="output follows this context-free grammar (Lark or GBNF syntax)"
    )
    json_object: bool | None = Field(None, description="true: output is any JSON object")
    disable_additional_properties: bool | None = Field(
        None,
        description="with json: an object schema with properties and no additionalProperties "
        "gets additionalProperties false, as in vLLM",
    )
    disable_any_whitespace: Annotated[bool, AfterValidator(_only_false)] | None = Field(
        None, description="only false: compact JSON is not enforced (true is a 400)"
    )
    whitespace_pattern: refused("a custom JSON whitespace pattern is not supported") = None
    structural_tag: refused("structural tags are not supported") = None

    @model_validator(mode="after")
    def _exactly_one_constraint(self) -> StructuredOutputs:
        given = [name for name in CONSTRAINTS if self._value(name) not in (None, False)]
        if not given:
            raise field_error(
                (), MISSING, f"needs a constraint: one of {', '.join(CONSTRAINTS)}", None
            )
        if len(given) > 1:
            raise field_error(
                given[1],
                INVALID_VALUE,
                f"cannot be combined with '{given[0]}': give one of {', '.join(CONSTRAINTS)}",
                self._value(given[1]),
            )
        return self

    def _value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def guide(self) -> Guide:
        """(kind, spec, where): ``where`` is the spec's path, for a grammar that fails to
        compile (``structured_outputs.grammar``)."""
        where: tuple[str, ...] = ("structured_outputs",)
        if self.json_ is not None:
            schema = self.json_
            if self.disable_additional_properties:
                schema = no_additional_properties(schema)
            return "json_schema", json.dumps(schema), (*where, "json")
        if self.regex is not None:
            return "regex", self.regex, (*where, "regex")
        if self.choice is not None:
            return "choice", json.dumps(self.choice), (*where, "choice")
        if self.grammar is not None:
            return "grammar", self.grammar, (*where, "grammar")
        return "json_object", "", (*where, "json_object")


SCHEMA_NAME = "^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for json_schema.name


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(pattern=SCHEMA_NAME)]
    schema_: SchemaObject = Field(alias="schema", description="the JSON schema to follow")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")
    description: str | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type 'json_schema'")

    @model_validator(mode="after")
    def _schema_goes_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error(
                "json_schema", MISSING, "is required when 'type' is 'json_schema'", None
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise field_error(
                "json_schema",
                INVALID_VALUE,
                "is only allowed when 'type' is 'json_schema'",
                self.json_schema,
            )
        return self

    def guide(self) -> Guide | None:
        if self.type == "json_object":
            return "json_object", "", ("response_format",)
        if self.json_schema is not None:
            where = ("response_format", "json_schema", "schema")
            return "json_schema", json.dumps(self.json_schema.schema_), where
        return None  # "text"


GUIDES = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")


class GuidedFields(StrictModel):
    response_format: ResponseFormat | None = Field(
        None, description="structured output (OpenAI): text, json_object or json_schema"
    )
    guided_json: GuidedJson | None = Field(
        None, description="vLLM's: output follows this JSON schema (an object or a string)"
    )
    guided_regex: Regex | None = Field(
        None, description="vLLM's: output matches this regular expression"
    )
    guided_choice: Choices | None = Field(
        None, description="vLLM's: output is exactly one of these strings"
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="vLLM's current name for guided_*: one of json, regex, choice, grammar "
        "(Lark or GBNF) or json_object",
    )
    _guided: GuidedDecoding | None = PrivateAttr(None)
    _guided_param: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_guide_that_fits(self) -> GuidedFields:
        given = [guide for name in GUIDES if (guide := self._guide(name)) is not None]
        if len(given) > 1:
            first, second = given[0][2][0], given[1][2][0]
            raise field_error(
                second,
                INVALID_VALUE,
                f"cannot be combined with '{first}': give at most one of {', '.join(GUIDES)}",
                getattr(self, second),
            )
        if given:
            kind, spec, where = given[0]
            if len(spec) > MAX_GUIDED_SPEC_CHARS:
                raise field_error(
                    where,
                    INVALID_VALUE,
                    f"is longer than {MAX_GUIDED_SPEC_CHARS} characters as JSON",
                    spec[:100],
                )
            self._guided = GuidedDecoding(kind, spec)
            # What a grammar that fails to compile is reported at: the field, or within
            # structured_outputs its key.
            self._guided_param = ".".join(
                where[:2] if where[0] == "structured_outputs" else where[:1]
            )
        return self

    def _guide(self, name: str) -> Guide | None:
        if name == "response_format":
            return self.response_format.guide() if self.response_format else None
        if name == "guided_json" and self.guided_json is not None:
            return "json_schema", json.dumps(self.guided_json), (name,)
        if name == "guided_regex" and self.guided_regex is not None:
            return "regex", self.guided_regex, (name,)
        if name == "guided_choice" and self.guided_choice is not None:
            return "choice", json.dumps(self.guided_choice), (name,)
        if name == "structured_outputs" and self.structured_outputs is not None:
            return self.structured_outputs.guide()
        return None

    @property
    def guided(self) -> GuidedDecoding | None:
        """The request's output constraint, if any."""
        return self._guided

    @property
    def guided_param(self) -> str | None:
        """The parameter that set ``guided`` (``structured_outputs.regex``, ``guided_json``)."""
        return self._guided_param
