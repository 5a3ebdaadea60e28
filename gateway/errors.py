"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway reports, bad input or server fault, goes through :class:`APIError` so
clients (the official ``openai`` package included) can parse it. Bad input is always a 4xx; a 5xx
means the server, not the client, failed.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported_parameter(name: str) -> APIError:
    return APIError(
        400, f"Unsupported parameter: '{name}'", param=name, code="unsupported_parameter"
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def unauthorized(message: str = "Invalid API key") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> APIError:
    """A key that is valid, but not for this endpoint (a user's key on an admin route)."""
    return APIError(403, message, code="permission_denied")


def retry_after_header(seconds: float) -> dict[str, str]:
    # Retry-After is whole seconds (RFC 9110); round up so clients never retry too early.
    return {"Retry-After": str(max(1, int(seconds + 0.999)))}


def rate_limited(message: str, kind: str, retry_after: float) -> APIError:
    """429 as OpenAI words it: ``type`` says which limit (``requests`` or ``tokens``)."""
    return APIError(
        429, message, type=kind, code="rate_limit_exceeded", headers=retry_after_header(retry_after)
    )


def request_timeout(message: str) -> APIError:
    return APIError(408, message, code="request_timeout")


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes", code="request_too_large")


def overloaded(message: str, retry_after: float = 1.0) -> APIError:
    return APIError(503, message, code="overloaded", headers=retry_after_header(retry_after))


def server_error(message: str, code: str = "internal_error") -> APIError:
    return APIError(500, message, code=code)


def timeout_error(message: str) -> APIError:
    return APIError(504, message, type="timeout_error", code="timeout")
