"""``/openapi.json``'s entries for Anthropic's Messages API: the request models (``bodies.py``)
and response models (``response_models.py``) under their published names, and the two paths.
``gateway/openapi.py`` merges them into the one document."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pdserve.gateway.anthropic.bodies import CountTokensBody, MessagesBody
from pdserve.gateway.anthropic.response_models import (
    STREAM_EVENTS,
    AnthropicError,
    AnthropicMessage,
    CountTokensResponse,
)
from pdserve.gateway.schema_base import StrictModel

REF_TEMPLATE = "#/components/schemas/{model}"

REQUEST_MODELS: dict[str, type[StrictModel]] = {
    "MessagesRequest": MessagesBody,
    "CountTokensRequest": CountTokensBody,
}
RESPONSE_MODELS: dict[str, type[BaseModel]] = {
    "MessagesResponse": AnthropicMessage,
    "CountTokensResponse": CountTokensResponse,
    "AnthropicError": AnthropicError,
    **{model.__name__: model for model in STREAM_EVENTS.values() if model is not AnthropicError},
}
# x-api-key, as Anthropic's clients send a key (a Bearer token is accepted too)
SECURITY_SCHEME = {"type": "apiKey", "in": "header", "name": "x-api-key"}
SECURITY: list[dict[str, list[str]]] = [{"bearer": []}, {"x-api-key": []}, {}]

_ERRORS = {
    400: "invalid_request_error (the message names the offending parameter)",
    401: "authentication_error: missing or wrong API key",
    404: "not_found_error: unknown model",
    413: "request_too_large",
    500: "api_error",
    502: "api_error: a worker failed the request",
    504: "timeout_error: a deadline passed",
    529: "overloaded_error: no worker available or the queue is full (see Retry-After)",
}
STREAM = (
    "the message as one JSON body, or with stream=true Anthropic's server-sent events: "
    "'event: <type>' then 'data: <json>' of that type (message_start, ping, "
    "content_block_start, content_block_delta, content_block_stop, message_delta, "
    "message_stop); a failure after the stream began is an 'error' event, and the stream ends"
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _errors(*codes: int) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref("AnthropicError")}}
    return {str(c): {"description": _ERRORS[c], "content": content} for c in codes}


def _op(summary: str, request: str, ok: dict[str, Any], *codes: int) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": SECURITY,
            "parameters": [
                {
                    "name": "anthropic-version",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "accepted, whatever its value",
                }
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": ok, **_errors(*codes)},
        }
    }


def paths() -> dict[str, Any]:
    events = [_ref(name) for name in RESPONSE_MODELS if name.endswith("Event")]
    return {
        "/v1/messages": _op(
            "Anthropic's Messages API, served as the chat endpoint serves the conversation",
            "MessagesRequest",
            {
                "description": STREAM,
                "content": {
                    "application/json": {"schema": _ref("MessagesResponse")},
                    # as for the chat chunks: the schema of each event's data
                    "text/event-stream": {"schema": {"anyOf": [*events, _ref("AnthropicError")]}},
                },
            },
            400,
            401,
            404,
            413,
            500,
            502,
            504,
            529,
        ),
        "/v1/messages/count_tokens": _op(
            "The prompt's tokens, as /v1/messages renders the conversation and tools",
            "CountTokensRequest",
            {
                "description": "the count",
                "content": {"application/json": {"schema": _ref("CountTokensResponse")}},
            },
            400,
            401,
            404,
            413,
        ),
    }
