"""The value types of structured output's specs, shared by OpenAI's and vLLM's spellings of them
(``guided_fields.py``: ``response_format``, ``guided_*``; ``structured_outputs_field.py``: vLLM's
``structured_outputs``), so each spec is checked the same way whichever field carries it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from pdserve.gateway.json_body import loads_bounded
from pdserve.gateway.schema_base import shaped
from pdserve.gateway.schema_errors import INVALID_VALUE
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS


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
