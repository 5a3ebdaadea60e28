"""The gateway's OpenAPI 3.1 description, served at ``/openapi.json``.

Sampling fields, the fields accepted because they change nothing, and ``stream_options`` come
from the same tables the validator uses (``api_models.SAMPLING_FIELDS``, ``neutral_fields``,
``stream_options``), and ``additionalProperties: false`` states that unsupported parameters are
refused.
"""

from __future__ import annotations

from typing import Any

from gateway.api_models import ALLOWED_ROLES, MAX_STOP_STRINGS, SAMPLING_FIELDS
from gateway.neutral_fields import neutral_schemas
from gateway.number_fields import number_schema
from gateway.stream_options import stream_options_schema


def _common_properties(model: str, chat: bool) -> dict[str, Any]:
    props: dict[str, Any] = {
        "model": {"type": "string", "description": "served model name", "examples": [model]},
        "stream": {"type": ["boolean", "null"], "default": False},
        "stream_options": stream_options_schema(),
        "stop": {
            "description": "stop strings, matched on the generated text and not returned",
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "maxItems": MAX_STOP_STRINGS,
                },
                {"type": "null"},
            ],
        },
        "ignore_eos": {"type": ["boolean", "null"], "description": "keep going past EOS"},
    }
    for f in SAMPLING_FIELDS:
        props[f.name] = number_schema(f)
    props.update(neutral_schemas(chat))
    return props


def _error_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }


def _usage_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": {"type": "integer"}},
                "description": "not in the running usage of continuous_usage_stats",
            },
        },
    }


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "invalid request (names the offending parameter)",
        401: "missing or wrong API key",
        404: "unknown model",
        409: "x-request-id already in flight",
        413: "request body too large",
        502: "a worker failed the request",
        503: "no worker available or admission queue full (see Retry-After)",
        504: "deadline passed",
    }
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": text[c], "content": ref} for c in codes}


def _generation_op(summary: str, request_ref: str, response_ref: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {}],
            "parameters": [
                {
                    "name": "x-request-id",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_\\-:]{1,128}$"},
                    "description": "honoured, returned, and put on every span of the request",
                }
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": request_ref}}},
            },
            "responses": {
                "200": {
                    "description": "the completion, or with stream=true server-sent events "
                    "ending in 'data: [DONE]' (with stream_options.include_usage, the chunk "
                    "before it has 'choices': [] and the usage)",
                    "content": {
                        "application/json": {"schema": {"$ref": response_ref}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 409, 413, 502, 503, 504),
            },
        }
    }


def openapi_spec(model: str) -> dict[str, Any]:
    completion_request = {
        "type": "object",
        "required": ["model", "prompt"],
        "additionalProperties": False,
        "properties": {
            **_common_properties(model, chat=False),
            "prompt": {
                "description": "text, or a list of token ids",
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                ],
            },
        },
    }
    message = {
        "type": "object",
        "required": ["role"],
        "additionalProperties": False,
        "properties": {
            "role": {"enum": list(ALLOWED_ROLES)},
            "name": {"type": "string"},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "additionalProperties": False,
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                    },
                    {"type": "null"},
                ]
            },
        },
    }
    chat_request = {
        "type": "object",
        "required": ["model", "messages"],
        "additionalProperties": False,
        "properties": {
            **_common_properties(model, chat=True),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_completion_tokens": number_schema(SAMPLING_FIELDS[0]),
        },
    }
    finish = {"enum": ["stop", "length", "abort", "error"]}
    completion_response = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "finish_reason": finish,
                    },
                },
            },
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    }
    chat_response = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": "string"},
                            },
                        },
                        "finish_reason": finish,
                    },
                },
            },
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pdserve",
            "version": "0.1.0",
            "description": "OpenAI-compatible API of pdserve (disaggregated prefill/decode).",
        },
        "paths": {
            "/v1/completions": _generation_op(
                "Text completion",
                "#/components/schemas/CompletionRequest",
                "#/components/schemas/CompletionResponse",
            ),
            "/v1/chat/completions": _generation_op(
                "Chat completion (the model's chat template)",
                "#/components/schemas/ChatCompletionRequest",
                "#/components/schemas/ChatCompletionResponse",
            ),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "security": [{"bearer": []}, {}],
                    "responses": {"200": {"description": "model list"}, **_errors(401)},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model by name",
                    "security": [{"bearer": []}, {}],
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {"200": {"description": "model card"}, **_errors(401, 404)},
                }
            },
            "/health": {
                "get": {
                    "summary": "200 while NATS is connected and a decode worker is alive",
                    "security": [],
                    "responses": {
                        "200": {"description": "ready"},
                        "503": {"description": "not ready"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text format)",
                    "security": [],
                    "responses": {"200": {"description": "metrics"}},
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _error_schema(),
                "Usage": _usage_schema(),
                "CompletionRequest": completion_request,
                "ChatCompletionRequest": chat_request,
                "CompletionResponse": completion_response,
                "ChatCompletionResponse": chat_response,
            },
        },
    }
