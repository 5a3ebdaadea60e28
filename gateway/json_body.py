"""A request body as a JSON object, or an OpenAI-shaped 400 that says what is wrong with it:
not UTF-8, empty, not JSON, NaN or Infinity, not an object, nested too deeply, lone surrogates."""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.gateway.errors import bad_request

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
