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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Union

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
from pydantic_core import PydanticCustomError

from pdserve.gateway.schema_errors import INVALID_TYPE, UNSUPPORTED, describe

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
    field: str | tuple[str, ...], code: str, phrase: str, value: Any
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
