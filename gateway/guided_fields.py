"""Structured output: OpenAI's ``response_format`` and vLLM's ``guided_json``, ``guided_regex``
and ``guided_choice``, read into one ``pdserve.shared.sampling.GuidedDecoding``.

- ``{"type": "text"}``: no constraint.
- ``{"type": "json_object"}``: any JSON object (kind ``json_object``).
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`` and
  ``guided_json`` (a schema object, or a string holding one): kind ``json_schema``, the spec is
  ``json.dumps(schema)``.
- ``guided_regex``: kind ``regex``; ``guided_choice`` (non-empty strings): kind ``choice``, the
  spec is ``json.dumps`` of the list.

At most one of them may constrain a request. Only their shape is checked here (a schema is an
object, a spec is at most ``MAX_GUIDED_SPEC_CHARS``); whether a grammar compiles is checked where
it is compiled.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.json_body import loads_bounded
from pdserve.gateway.schema_base import StrictModel, field_error, shaped
from pdserve.gateway.schema_errors import INVALID_VALUE, MISSING
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS, GuidedDecoding

SCHEMA_NAME = "^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for json_schema.name


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
Guide = tuple[str, str, tuple[str, ...]]  # (kind, spec, where the spec came from)


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


GUIDES = ("response_format", "guided_json", "guided_regex", "guided_choice")


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
    _guided: GuidedDecoding | None = PrivateAttr(None)

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
        return None

    @property
    def guided(self) -> GuidedDecoding | None:
        """The request's output constraint, if any."""
        return self._guided
