"""Structured output: OpenAI's ``response_format`` and vLLM's ``guided_json``, ``guided_regex``,
``guided_choice`` and ``structured_outputs``, read into one
``pdserve.shared.sampling.GuidedDecoding``.

- ``{"type": "text"}``: no constraint.
- ``{"type": "json_object"}``: any JSON object (kind ``json_object``).
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`` and
  ``guided_json`` (a schema object, or a string holding one): kind ``json_schema``, the spec is
  ``json.dumps(schema)``.
- ``guided_regex``: kind ``regex``; ``guided_choice`` (non-empty strings): kind ``choice``, the
  spec is ``json.dumps`` of the list.
- ``structured_outputs`` (vLLM's current spelling, ``structured_outputs_field.py``): the same
  kinds, and ``grammar`` (Lark or GBNF).

At most one of them may constrain a request. Only their shape is checked here (a schema is an
object, a spec is at most ``MAX_GUIDED_SPEC_CHARS``); whether a grammar compiles is checked where
it is compiled.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, model_validator

from pdserve.gateway.guide_specs import Choices, Guide, GuidedJson, Regex, SchemaObject
from pdserve.gateway.schema_base import StrictModel, field_error
from pdserve.gateway.schema_errors import INVALID_VALUE, MISSING
from pdserve.gateway.structured_outputs_field import StructuredOutputs
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS, GuidedDecoding

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
