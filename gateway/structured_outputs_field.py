"""vLLM's ``structured_outputs`` object, its current name for the ``guided_*`` fields, read into
the same one ``GuidedDecoding`` (``guided_fields.py`` keeps it the only guide of a request).

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
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.guide_specs import Choices, Grammar, Guide, GuidedJson, Regex
from pdserve.gateway.schema_base import StrictModel, field_error, refused
from pdserve.gateway.schema_errors import INVALID_VALUE, MISSING, UNSUPPORTED
from pdserve.shared.structured_output import JSON_MAX_WHITESPACE

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
