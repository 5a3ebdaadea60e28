"""What every request model shares: strict types, unknown fields refused, null taken as absent,
and the few validators the field modules build on.

- ``StrictModel``: pydantic's strict mode (no ``"1"`` for 1, no ``true`` for 1), unknown fields
  refused (``extra="forbid"``), and a ``null`` for any field, known or not, read as if the field
  were left out: some SDKs send every optional field, null when unset. ``/openapi.json`` says the
  same with ``additionalProperties: {"type": "null"}``.
- ``shaped``: a union whose member is picked by the value's JSON shape. pydantic's own unions put
  the member's label into an error's ``loc`` (``prompt.list[int].1``); picking the member first
  keeps the path the client wrote (``prompt[1]``) and gives one clear error for a wrong shape.
- ``reported_whole``: errors inside a map of the client's own keys (``metadata``,
  ``logit_bias``) are reported at the field, the key named in the message.
- ``refused``: a field documented in ``/openapi.json`` only to say it is not supported.
- ``field_error``: a model validator's error on one field (cross-field rules name a field too).

Errors: pydantic's ``ValidationError`` as the one OpenAI-shaped 400 the gateway answers bad input with.

The request models (``gateway/request_bodies.py`` and the field modules it builds on) let
pydantic check every field; ``api_error`` below is the single place its errors become
``{"error": {"message", "type", "param", "code"}}``. One error is reported, the first, except
that an unsupported top-level parameter goes before everything else (as the hand-written checks
did): a client told ``Unsupported parameter: 'tools'`` learns more than one told about a typo
further down. ``loc`` becomes ``param`` as ``messages[2].content`` or
``stream_options.include_usage``, and the message reads ``'<param>' must be ...``.

Errors the models raise themselves are ``PydanticCustomError``s whose type is the OpenAI
``code`` and whose message is the phrase after the parameter's name.

Before any model: ``parse_json_body`` reads a request body as a JSON object, or an OpenAI-shaped 400 that says what is wrong with it:
not UTF-8, empty, not JSON, NaN or Infinity, not an object, nested too deeply, lone surrogates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

from pdserve.gateway.errors import APIError, bad_request

MAX_NESTING = 32  # deeper JSON than this is never a legitimate request


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise a 400 that says what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"Request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise bad_request("Request body is empty; expected a JSON object")
    try:
        body = loads_bounded(text)
    except ValueError as exc:
        raise bad_request(f"Request body {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, not {_json_type(body)}")
    return body


def loads_bounded(text: str) -> Any:
    """``text`` as JSON within the same limits as a body (also for JSON inside a field, such as
    a schema sent as a string); a ValueError says what is wrong, to follow 'Request body'."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, huge integers, NaN/Infinity
        raise ValueError(f"is not valid JSON: {exc}") from None
    if _depth(value) > MAX_NESTING:
        raise ValueError(f"is nested deeper than {MAX_NESTING} levels")
    if _has_lone_surrogate(value):
        # JSON's \ud800-style escapes can encode half a character, which is not text: the
        # tokenizer and UTF-8 output would both fail on it later.
        raise ValueError("contains an unpaired UTF-16 surrogate escape")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, iteratively so that it cannot overflow the stack."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


MAX_KEY_SHOWN = 40  # characters of a client's map key quoted in an error message


def _unknown_fields_may_only_be_null(schema: dict[str, Any]) -> None:
    schema["additionalProperties"] = {"type": "null"}


class StrictModel(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="forbid", json_schema_extra=_unknown_fields_may_only_be_null
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            return {k: v for k, v in data.items() if v is not None}
        return data


def field_error(
    field: str | tuple[str | int, ...], code: str, phrase: str, value: Any
) -> ValidationError:
    """An error on ``field`` (a name, or a path, relative to the model raising it), for model
    validators."""
    loc = (field,) if isinstance(field, str) else field
    error = PydanticCustomError(code, phrase)
    return ValidationError.from_exception_data(
        "request", [{"type": error, "loc": loc, "input": value}]
    )


def shaped(*members: Any, pick: Callable[[Any], int | None], otherwise: str) -> PlainValidator:
    """Validate a value as ``members[pick(value)]``; ``pick`` returns None for a shape none of
    them has, which is an error saying ``otherwise`` (what the field must be)."""
    adapters = [TypeAdapter(member) for member in members]

    def validate(value: Any) -> Any:
        index = pick(value)
        if index is None:
            raise PydanticCustomError(INVALID_TYPE, otherwise)
        return adapters[index].validate_python(value, strict=True)

    return PlainValidator(validate, json_schema_input_type=Union[members])  # noqa: UP007


def reported_whole() -> WrapValidator:
    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            code, phrase = describe(error)
            raise PydanticCustomError(code, _entry(error["loc"]) + phrase) from None

    return WrapValidator(validate)


def _entry(loc: tuple[int | str, ...]) -> str:
    """Where in the map: '' (the map itself), "entry 'k' " (its value) or "key 'k' "."""
    if not loc:
        return ""
    key = str(loc[0])
    if len(key) > MAX_KEY_SHOWN:
        key = key[:MAX_KEY_SHOWN] + "..."
    return f"{'key' if loc[-1] == '[key]' else 'entry'} {key!r} "


def refused(why: str) -> Any:
    """A field that is never accepted (except as null): a 400 ``unsupported_parameter``."""

    def validate(value: Any) -> None:
        raise PydanticCustomError(UNSUPPORTED, why)

    return Annotated[
        None,
        PlainValidator(validate, json_schema_input_type=None),
        Field(description=f"{why}: any value but null is a 400 unsupported_parameter"),
    ]


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
