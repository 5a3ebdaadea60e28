"""The gateway's middlewares, outermost first as ``create_app`` installs them: request ids (the
client's ``x-request-id`` or a new one; its arrival time), tracing (a server span for the
generation endpoints) and errors (every failure leaves as OpenAI-shaped JSON, or Anthropic-shaped
on Anthropic's ``/v1/messages``: ``gateway/anthropic/errors.py``). The innermost one, keys and
each route's access class, is ``gateway/access.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve.gateway.anthropic.errors import error_response, is_anthropic_path
from pdserve.gateway.app_state import ARRIVED_KEY, CLIENT_ID_KEY, GATEWAY_KEY
from pdserve.gateway.errors import (
    APIError,
    bad_request,
    payload_too_large,
    server_error,
)
from pdserve.shared.bus.subjects import is_subject_token
from pdserve.shared.telemetry import tracing as tr

log = logging.getLogger(__name__)
_tracer = tr.tracer(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_answer(request: web.Request, err: APIError) -> web.Response:
    """``err`` in the shape of the API the client called."""
    return error_response(err) if is_anthropic_path(request.path) else err.response()


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[ARRIVED_KEY] = time.monotonic()  # TTFT and E2E count from here
    client_id = request.headers.get("x-request-id")
    if client_id is None or client_id == "":
        client_id = uuid.uuid4().hex
    elif not is_subject_token(client_id):
        err = bad_request(
            "x-request-id must be 1-128 characters of letters, digits, '_', '-' or ':'",
            "x-request-id",
            "invalid_request_id",
        )
        response = error_answer(request, err)
        response.headers["x-request-id"] = uuid.uuid4().hex
        return response
    request[CLIENT_ID_KEY] = client_id
    response = await handler(request)
    if not response.prepared:
        response.headers["x-request-id"] = client_id
    return response


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in GENERATION_PATHS:
        return await handler(request)
    # The HTTP server span is the trace's root (or joins a client's trace if it sent one).
    parent = tr.extract_context(request.headers)
    with _tracer.start_as_current_span(
        f"POST {request.path}", context=parent, kind=SpanKind.SERVER
    ) as span:
        span.set_attribute(tr.ATTR_REQUEST_ID, request[CLIENT_ID_KEY])
        span.set_attribute("http.request.method", "POST")
        span.set_attribute("url.path", request.path)
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as the API's JSON (OpenAI's, or Anthropic's on its paths); bad input
    never becomes a 5xx."""
    try:
        return await handler(request)
    except APIError as err:
        return error_answer(request, err)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[GATEWAY_KEY].config.max_body_bytes
        return error_answer(request, payload_too_large(limit))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found" if exc.status == 404 else "http_error"
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        err = APIError(exc.status, exc.reason or "HTTP error", code=kind, headers=allow)
        return error_answer(request, err)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_answer(request, server_error("internal server error"))
