"""Every HTTP request the gateway answers, counted by endpoint and status
(``pdserve_http_requests_total``): the generation endpoints, ``/tokenize``, ``/v1/models``,
probes and scrapes alike, errors included.

The endpoint is the route's pattern (``/v1/models/{model}``, never the model named in the
path), so clients cannot grow the label set; a path no route matches counts as ``unmatched``.
The middleware is the outermost, so it sees the status the client got, after errors became
OpenAI-shaped responses. A request whose client went away before the answer ended (a cancelled
handler) is not counted here; ``pdserve_requests_total{finish_reason="abort"}`` counts those.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry, Counter

UNMATCHED = "unmatched"


def endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


def endpoint_metrics_middleware(registry: CollectorRegistry) -> Middleware:
    """The middleware, with its counter registered in the gateway's ``registry``."""
    counter = Counter(
        "pdserve_http_requests",
        "HTTP requests answered, by endpoint (the route: /v1/chat/completions, /tokenize, "
        "/v1/models/{model}, ...; 'unmatched' for no route) and status code.",
        ["endpoint", "status"],
        registry=registry,
    )

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # a redirect, or an error no inner layer turned
            counter.labels(endpoint=endpoint(request), status=str(exc.status)).inc()
            raise
        counter.labels(endpoint=endpoint(request), status=str(response.status)).inc()
        return response

    return count
