"""Who may call which route: every route is added with its access class (``add_route``), and one
middleware (``access_middleware``) checks the key a request presents against that class.

Classes:

- ``OPEN``: anyone (``/health`` for load balancers, ``/openapi.json`` for tooling).
- ``USER``: with ``--api-key`` set, one of those keys (or an admin key). With no ``--api-key``
  these routes are open, whatever else is configured: ``--admin-api-key`` alone closes only the
  admin surface.
- ``ADMIN``: with ``--admin-api-key`` set, only those keys; a user's key gets 403. With
  ``--api-key`` set and no admin key the admin routes are closed (403 naming
  ``--admin-api-key``): configuring user keys must never leave an operator's door open. With
  neither ``--api-key`` nor ``--admin-api-key``, everything but a closed ``/metrics`` is open,
  admin routes included (a local deployment).
- ``METRICS``: open unless ``--metrics-api-key`` is set; then a metrics key or an admin key.

A route added without a class is refused to everyone (fail closed), and
``tests/unit/test_access.py`` enumerates the app's routes so that such a route fails the tests
first. A request that matches no route needs a user key before it learns so (404).

Keys are compared in constant time against every configured key (``hmac.compare_digest``), so
timing reveals neither a key nor which one matched. A request is known by its key's id
(``key_id``: a short SHA-256 prefix, what metrics and limits name; never the key).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from pdserve.gateway.errors import forbidden, unauthorized

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ANONYMOUS = "anonymous"  # the key id of a request that presented no key (none is required)


class Access(enum.Enum):
    OPEN = "open"
    USER = "user"
    ADMIN = "admin"
    METRICS = "metrics"


ROUTE_ACCESS_KEY = web.AppKey("route_access", dict)  # resource's canonical path -> Access
KEY_ID_KEY = web.RequestKey("key_id", str)


def add_route(
    app: web.Application, method: str, path: str, handler: Handler, access: Access
) -> None:
    """Add a route with its access class (GET also answers HEAD). One path, one class."""
    table: dict[str, Access] = app.setdefault(ROUTE_ACCESS_KEY, {})
    if method == "GET":
        route = app.router.add_get(path, handler)
    else:
        route = app.router.add_route(method, path, handler)
    canonical = route.resource.canonical if route.resource is not None else path
    if table.get(canonical, access) is not access:
        raise ValueError(f"{path} is declared {table[canonical].value} and {access.value}")
    table[canonical] = access


def route_access(app: web.Application, route: web.AbstractRoute) -> Access | None:
    """The declared class of ``route``; None when it was added without one."""
    if route.resource is None:
        return None
    return app.get(ROUTE_ACCESS_KEY, {}).get(route.resource.canonical)


def key_id(key: str) -> str:
    """What metrics and limits call a key: 12 hex digits of its SHA-256, never the key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


@dataclass(frozen=True)
class _Key:
    secret: bytes
    role: Access  # USER, ADMIN or METRICS
    id: str


class KeyPolicy:
    """The configured keys by role, and the decision for one request."""

    def __init__(self, user: list[str], admin: list[str], metrics: list[str]) -> None:
        self._keys = [
            _Key(k.encode("utf-8"), role, key_id(k))
            for role, keys in (
                (Access.USER, user),
                (Access.ADMIN, admin),
                (Access.METRICS, metrics),
            )
            for k in keys
            if k
        ]
        self._configured = {k.role for k in self._keys}

    def _roles(self, presented: str) -> tuple[set[Access], str]:
        """The roles ``presented`` holds, and its key id, comparing with every key."""
        candidate = presented.encode("utf-8", "surrogateescape")
        roles: set[Access] = set()
        found = ""
        for key in self._keys:  # no early exit: each comparison takes its own constant time
            if hmac.compare_digest(candidate, key.secret):
                roles.add(key.role)
                found = key.id
        return roles, found

    def authorize(self, access: Access, presented: str) -> str:
        """The key id the request runs under, or the 401/403 that refuses it."""
        accepted = self._accepted(access)
        if accepted is None:  # no key needed here: the request is anonymous
            return ANONYMOUS
        if not presented:
            raise unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        roles, found = self._roles(presented)
        if not roles:
            raise unauthorized("Incorrect API key provided")
        if not accepted:
            raise forbidden(
                "admin endpoints are closed: API keys are configured and no admin key is "
                "(--admin-api-key)"
            )
        if not roles & accepted:
            raise forbidden(f"this key may not call {access.value} endpoints")
        return found

    def _accepted(self, access: Access) -> set[Access] | None:
        """The roles that may call a route of class ``access``; None: anyone may."""
        configured = self._configured
        if access is Access.OPEN:
            return None
        if access is Access.METRICS:
            return {Access.METRICS, Access.ADMIN} if Access.METRICS in configured else None
        if access is Access.ADMIN:
            if Access.ADMIN in configured:
                return {Access.ADMIN}
            return set() if Access.USER in configured else None  # set(): closed to all
        return {Access.USER, Access.ADMIN} if Access.USER in configured else None


def access_middleware(policy: KeyPolicy) -> Middleware:
    @web.middleware
    async def check_access(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route
        if route.resource is None:  # no route matched: the 404 (or 405) is a user's to learn
            access = Access.USER
        else:
            declared = route_access(request.app, route)
            if declared is None:  # fail closed, whatever keys are configured
                log.error("route %s has no access class: refused", route.resource.canonical)
                raise forbidden("this route declares no access class")
            access = declared
        request[KEY_ID_KEY] = policy.authorize(access, presented_key(request))
        return await handler(request)

    return check_access


def presented_key(request: web.Request) -> str:
    """The key a client sent: Anthropic's ``x-api-key`` header when present (its SDKs send the
    key there), else the Bearer token; '' when neither holds one."""
    api_key = request.headers.get("x-api-key")
    if api_key is not None:
        return api_key.strip()
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
