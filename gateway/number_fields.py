"""One numeric request field: its JSON type, bounds and meaning, and the check of a value.

Kept apart from ``api_models`` so every module that validates a number (sampling fields, the
penalties accepted at their neutral value) shares one check, and ``/openapi.json`` one schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request


@dataclass(frozen=True)
class NumberField:
    """One numeric field: its JSON type, bounds and meaning."""

    name: str
    kind: str  # "integer" or "number"
    description: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    nullable: bool = True


def check_number(value: Any, spec: NumberField, param: str) -> float | int | None:
    """``value`` checked against ``spec`` (None stays None); a 400 naming ``param`` if bad."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{param}' must be {_article(spec.kind)}", param, "invalid_type")
    if spec.kind == "integer":
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"'{param}' must be an integer", param, "invalid_type")
            value = int(value)
    elif math.isnan(value) or math.isinf(value):
        raise bad_request(f"'{param}' must be a finite number", param, "invalid_value")
    if spec.minimum is not None:
        if spec.exclusive_minimum and value <= spec.minimum:
            raise bad_request(f"'{param}' must be > {spec.minimum}", param, "invalid_value")
        if not spec.exclusive_minimum and value < spec.minimum:
            raise bad_request(f"'{param}' must be >= {spec.minimum}", param, "invalid_value")
    if spec.maximum is not None and value > spec.maximum:
        raise bad_request(f"'{param}' must be <= {spec.maximum}", param, "invalid_value")
    return value


def number_schema(f: NumberField) -> dict[str, Any]:
    """The field's JSON schema for ``/openapi.json``."""
    schema: dict[str, Any] = {"type": [f.kind, "null"], "description": f.description}
    if f.minimum is not None:
        schema["exclusiveMinimum" if f.exclusive_minimum else "minimum"] = f.minimum
    if f.maximum is not None:
        schema["maximum"] = f.maximum
    return schema


def _article(kind: str) -> str:
    return "an integer" if kind == "integer" else "a number"
