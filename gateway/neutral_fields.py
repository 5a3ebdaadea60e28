"""Request fields accepted because they change nothing here, so clients that always send them
(OpenAI SDK defaults, benchmark and eval tools) are not refused.

Each is still type-checked like any other field: a wrong type or shape is a 400 that names it.
The penalties and ``logit_bias`` are accepted only at their neutral value (0, ``{}``); any other
value is a 400 ``unsupported_value``, since pdserve does not apply them yet and a client must
not believe it did. ``metadata``, ``store``, ``service_tier`` and ``parallel_tool_calls`` exist
on OpenAI's chat endpoint only, and are refused on ``/v1/completions`` as OpenAI's legacy
completions refuse them. Nothing is stored with ``store: true``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request, unsupported_value
from gateway.number_fields import NumberField, check_number

METADATA_MAX_KEYS = 16  # OpenAI's limits on metadata
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
PENALTY_RANGE = (-2.0, 2.0)


@dataclass(frozen=True)
class NeutralField:
    name: str
    check: Callable[[Any, str], None]  # (value, name); raises an APIError; never sees None
    schema: dict[str, Any]  # its JSON schema in /openapi.json (null is always allowed too)
    chat_only: bool = False


def _string(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name, "invalid_type")


def _boolean(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name, "invalid_type")


def _metadata(value: Any, name: str) -> None:
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object of strings", name, "invalid_type")
    if len(value) > METADATA_MAX_KEYS:
        raise bad_request(f"'{name}' has more than {METADATA_MAX_KEYS} keys", name, "invalid_value")
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise bad_request(
                f"'{name}' keys must be at most {METADATA_MAX_KEY_CHARS} characters",
                name,
                "invalid_value",
            )
        if not isinstance(item, str):
            raise bad_request(f"'{name}' values must be strings", name, "invalid_type")
        if len(item) > METADATA_MAX_VALUE_CHARS:
            raise bad_request(
                f"'{name}' values must be at most {METADATA_MAX_VALUE_CHARS} characters",
                name,
                "invalid_value",
            )


def _service_tier(value: Any, name: str) -> None:
    if not isinstance(value, str) or value not in SERVICE_TIERS:
        raise bad_request(
            f"'{name}' must be one of {', '.join(SERVICE_TIERS)}", name, "invalid_value"
        )


def _penalty(value: Any, name: str) -> None:
    spec = NumberField(name, "number", "", PENALTY_RANGE[0], PENALTY_RANGE[1])
    if check_number(value, spec, name) != 0:
        raise unsupported_value(name, "is only supported at 0 (no penalty)")


def _logit_bias(value: Any, name: str) -> None:
    if not isinstance(value, dict):
        raise bad_request(
            f"'{name}' must be an object of token ids to biases", name, "invalid_type"
        )
    if value:
        raise unsupported_value(name, "is only supported empty ({}, no bias)")


_PENALTY_SCHEMA = {
    "enum": [0, None],
    "description": "accepted at 0 (no penalty) only; other values in [-2, 2] are a 400",
}
FIELDS: tuple[NeutralField, ...] = (
    NeutralField("user", _string, {"type": "string", "description": "accepted and ignored"}),
    NeutralField("frequency_penalty", _penalty, _PENALTY_SCHEMA),
    NeutralField("presence_penalty", _penalty, _PENALTY_SCHEMA),
    NeutralField(
        "logit_bias",
        _logit_bias,
        {
            "type": "object",
            "maxProperties": 0,
            "description": "accepted empty only; a non-empty bias is a 400",
        },
    ),
    NeutralField(
        "metadata",
        _metadata,
        {
            "type": "object",
            "maxProperties": METADATA_MAX_KEYS,
            "propertyNames": {"maxLength": METADATA_MAX_KEY_CHARS},
            "additionalProperties": {"type": "string", "maxLength": METADATA_MAX_VALUE_CHARS},
            "description": "accepted and ignored",
        },
        chat_only=True,
    ),
    NeutralField(
        "store",
        _boolean,
        {"type": "boolean", "description": "accepted and ignored: nothing is stored"},
        chat_only=True,
    ),
    NeutralField(
        "service_tier",
        _service_tier,
        {"enum": list(SERVICE_TIERS), "description": "accepted and ignored"},
        chat_only=True,
    ),
    NeutralField(
        "parallel_tool_calls",
        _boolean,
        {"type": "boolean", "description": "accepted and ignored ('tools' are refused)"},
        chat_only=True,
    ),
)


def neutral_names(chat: bool) -> frozenset[str]:
    return frozenset(f.name for f in FIELDS if chat or not f.chat_only)


def check_neutral_fields(body: dict[str, Any], chat: bool) -> None:
    """Type-check the neutral fields present (a null counts as absent)."""
    for f in FIELDS:
        value = body.get(f.name)
        if value is not None and (chat or not f.chat_only):
            f.check(value, f.name)


def neutral_schemas(chat: bool) -> dict[str, Any]:
    """name -> JSON schema, null allowed, for ``/openapi.json``."""
    return {f.name: _nullable(f.schema) for f in FIELDS if chat or not f.chat_only}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "enum" in schema:
        values = schema["enum"] if None in schema["enum"] else [*schema["enum"], None]
        return {**schema, "enum": values}
    return {**schema, "type": [schema["type"], "null"]}
