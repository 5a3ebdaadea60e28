"""Optional Bearer API keys (``--api-key``, several allowed).

Only the API under ``/v1/`` is protected. ``/health`` stays open for load balancers and
orchestrators, and ``/metrics`` and ``/openapi.json`` stay open for scrapers and tooling, as in
other OpenAI-compatible servers; none of them reveals prompts or output.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdserve.gateway.errors import unauthorized

PROTECTED_PREFIX = "/v1/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def key_matches(presented: str, keys: list[bytes]) -> bool:
    candidate = presented.encode("utf-8", "surrogateescape")
    # Compare against every key in constant time, so timing reveals neither key nor which one.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key)
    return matched


def api_key_middleware(api_keys: list[str]) -> Middleware:
    keys = [k.encode("utf-8") for k in api_keys if k]

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not keys or not request.path.startswith(PROTECTED_PREFIX):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        if not key_matches(token.strip(), keys):
            raise unauthorized("Incorrect API key provided")
        return await handler(request)

    return check_api_key
