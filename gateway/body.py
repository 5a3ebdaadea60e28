"""Reading a request's JSON body within the gateway's limits: no larger than
``--max-body-bytes`` (413) and no slower than ``--http-body-timeout`` (408), so a client that
sends its body a byte at a time (slowloris) cannot hold a request open for ever. The headers'
own deadline is aiohttp's keep-alive timer (``--http-keepalive-timeout``, ``create_app``)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pdserve.gateway.app_state import GATEWAY_KEY
from pdserve.gateway.errors import payload_too_large, request_timeout
from pdserve.gateway.schema_base import parse_json_body


async def read_json(request: web.Request) -> dict[str, Any]:
    config = request.app[GATEWAY_KEY].config
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise payload_too_large(limit)
    try:
        async with asyncio.timeout(config.http_body_timeout):
            raw = await request.read()  # aiohttp enforces client_max_size while reading
    except TimeoutError:
        # The connection is closed after the answer: what is left of the body is unread.
        raise request_timeout(
            f"the request body did not arrive within {config.http_body_timeout:g} s "
            "(--http-body-timeout)"
        ) from None
    return parse_json_body(raw)
