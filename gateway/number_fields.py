"""The numeric field types of the request models, their bounds read from ``pdserve.shared.sampling``.

Strict, as pydantic's strict mode is: a boolean or a string is never a number. One leniency is
kept from the hand-written checks: an integer field takes a float with no fraction (``8.0``),
which JSON does not tell apart from ``8`` and some clients write; ``1.5`` stays an error.
Numbers must be finite (the JSON pre-parser already refuses NaN and Infinity; this holds for
callers that build the body in Python too).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from pdserve.shared.bus.protocol import MAX_TOKEN_ID
from pdserve.shared.sampling import BOUNDS


def _whole_float_as_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # anything else is left for the strict int check to refuse


def integer(minimum: int | None = None, maximum: int | None = None) -> Any:
    """An integer type in [minimum, maximum] (either end may be open-ended)."""
    # The bounds first, so that they stay on the int schema (and its JSON schema) inside the
    # before-validator.
    return Annotated[int, Field(ge=minimum, le=maximum), BeforeValidator(_whole_float_as_int)]


def bounded_integer(name: str, minimum: int | None = None) -> Any:
    """An integer type with ``pdserve.shared.sampling.BOUNDS[name]`` (``minimum`` may raise the floor)."""
    bound = BOUNDS[name]
    low = int(bound.lo) + (1 if bound.lo_open else 0)
    return integer(low if minimum is None else max(low, minimum), int(bound.hi))


def bounded_number(name: str) -> Any:
    """A finite number type with ``pdserve.shared.sampling.BOUNDS[name]``."""
    bound = BOUNDS[name]
    low = {"gt": bound.lo} if bound.lo_open else {"ge": bound.lo}
    return Annotated[float, Field(le=bound.hi, allow_inf_nan=False, **low)]


# A token id as the wire protocol bounds it; the vocabulary is checked once the model is known.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
