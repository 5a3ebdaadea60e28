"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, for every failure
on ``/v1/messages`` and ``/v1/messages/count_tokens``.

The gateway raises one kind of error (``gateway/errors.py``'s ``APIError``) whatever the API;
the error middleware and the Messages stream hand it here when the path is Anthropic's
(``is_anthropic_path``). The type follows the status as Anthropic's documentation lists them,
and one status moves: Anthropic says "overloaded" with 529 (``overloaded_error``; its SDK raises
``OverloadedError`` and retries), where the OpenAI side answers 503. Headers travel unchanged
(``Retry-After``, ``WWW-Authenticate``). The message keeps the parameter's name
(``'messages[1].content' must be ...``), as Anthropic's messages name the field at fault.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pdserve.gateway.errors import APIError

PATH = "/v1/messages"  # and everything under it (count_tokens)

OVERLOADED_STATUS = 529  # Anthropic's "overloaded" (ours: 503)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def status_of(err: APIError) -> int:
    return OVERLOADED_STATUS if err.status == 503 else err.status


def type_of(status: int) -> str:
    """Anthropic's error type for a status: its own table, ``api_error`` for other server
    faults, ``invalid_request_error`` for other client errors (a 409 duplicate request id)."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(err: APIError) -> dict[str, Any]:
    """The body of an error response, and the data of a stream's ``error`` event."""
    return {"type": "error", "error": {"type": type_of(status_of(err)), "message": err.message}}


def error_response(err: APIError) -> web.Response:
    return web.json_response(error_body(err), status=status_of(err), headers=err.headers)
