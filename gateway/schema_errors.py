"""pydantic's ``ValidationError`` as the one OpenAI-shaped 400 the gateway answers bad input with.

The request models (``gateway/request_bodies.py`` and the field modules it builds on) let
pydantic check every field; this module is the single place its errors become
``{"error": {"message", "type", "param", "code"}}``. One error is reported, the first, except
that an unsupported top-level parameter goes before everything else (as the hand-written checks
did): a client told ``Unsupported parameter: 'tools'`` learns more than one told about a typo
further down. ``loc`` becomes ``param`` as ``messages[2].content`` or
``stream_options.include_usage``, and the message reads ``'<param>' must be ...``.

Errors the models raise themselves are ``PydanticCustomError``s whose type is the OpenAI
``code`` and whose message is the phrase after the parameter's name.
"""

from __future__ import annotations

from typing import get_args

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from pydantic_core.core_schema import ErrorType

from pdserve.gateway.errors import APIError, bad_request

UNSUPPORTED = "unsupported_parameter"  # the code (and custom error type) of a refused field
MISSING = "missing_required_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"

# pydantic's error type -> the phrase after the parameter's name; a value error's phrase may
# name entries of the error's ctx (its bounds).
_TYPE_ERRORS = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "none_required": "must be null",
}
_VALUE_ERRORS = {
    "finite_number": "must be a finite number",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be {expected}",
    "string_pattern_mismatch": "must match the pattern {pattern}",
    "string_too_long": "must be at most {max_length} characters long",
}
_PYDANTIC_TYPES = frozenset(get_args(ErrorType))


def api_error(exc: ValidationError) -> APIError:
    """The 400 for a request body that failed validation."""
    error = _first(exc.errors(include_url=False))
    param = param_of(error["loc"]) or None
    code, phrase = describe(error)
    if code == UNSUPPORTED:
        detail = f" ({phrase})" if phrase else ""
        return bad_request(f"Unsupported parameter: '{param}'{detail}", param, UNSUPPORTED)
    if param is None:
        return bad_request(f"Request body {phrase}", None, code)
    return bad_request(f"'{param}' {phrase}", param, code)


def describe(error: ErrorDetails) -> tuple[str, str]:
    """(code, phrase) for one pydantic error: the phrase follows the parameter's name."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "missing":
        return MISSING, "is required"
    if kind == "extra_forbidden":
        return UNSUPPORTED, ""
    if kind in _TYPE_ERRORS:
        return INVALID_TYPE, _TYPE_ERRORS[kind]
    if kind in _VALUE_ERRORS:
        return INVALID_VALUE, _VALUE_ERRORS[kind].format(**ctx)
    if kind in ("string_too_short", "too_short"):
        least = ctx.get("min_length", 1)
        return INVALID_VALUE, "must not be empty" if least == 1 else f"needs at least {least} items"
    if kind == "too_long":
        unit = "entries" if ctx.get("field_type") == "Dictionary" else "items"
        return INVALID_VALUE, f"must have at most {ctx.get('max_length')} {unit}"
    if kind in _PYDANTIC_TYPES:
        # Any other built-in error: pydantic's own text, in the same voice.
        return INVALID_VALUE, error["msg"].replace("Input should", "must", 1)
    return kind, error["msg"]  # ours (PydanticCustomError): the type is the code


def param_of(loc: tuple[int | str, ...]) -> str:
    """``('messages', 2, 'content')`` -> ``messages[2].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _first(errors: list[ErrorDetails]) -> ErrorDetails:
    for error in errors:
        if len(error["loc"]) == 1 and error["type"] in ("extra_forbidden", UNSUPPORTED):
            return error
    return errors[0]
