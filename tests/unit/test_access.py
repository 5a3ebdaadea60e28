"""Who may call which route (``gateway/access.py``), through the real app on the in-memory bus:
every route of the app has an access class (the enumeration below fails on a new route added
without one), user routes outside ``/v1/`` (``/tokenize``, ``/detokenize``) need a key, admin
routes take only admin keys (a user's key: 403; no admin key configured: closed), ``/metrics``
closes with ``--metrics-api-key``, and Anthropic's paths keep Anthropic's error shape."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.gateway.access import Access, add_route, route_access
from pdserve.gateway.server import create_app
from pdserve.services.control.launch_checks import metrics_key, registered_names
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
from pdserve.shared.discovery.cache_reset import answer_resets
from tests.bus_memory import MemoryBus
from tests.unit.anthropic_fixtures import ASK
from tests.unit.fake_workers import MODEL, NAMESPACE
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir

USER, ADMIN, METRICS = "user-key", "admin-key", "metrics-key"
TOKENIZE = {"prompt": "Hello"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(300), max_position_embeddings=1024)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def openai_error(response, status: int, code: str) -> str:
    assert response.status == status, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    return error["message"]


def undeclared(app: web.Application) -> list[str]:
    """The routes of ``app`` added without an access class."""
    return [
        f"{route.method} {route.resource.canonical if route.resource else route}"
        for route in app.router.routes()
        if route_access(app, route) is None
    ]


async def empty(request: web.Request) -> web.Response:
    return web.Response()


async def test_every_route_declares_its_access_class(model_dir):
    bus = BusConfig(namespace=NAMESPACE)
    app = create_app(
        GatewayConfig(), EngineConfig(model=str(model_dir)), bus, message_bus=MemoryBus(bus, "gw")
    )
    assert undeclared(app) == []
    classes = {
        r.resource.canonical: route_access(app, r) for r in app.router.routes() if r.resource
    }
    assert classes["/health"] is Access.OPEN and classes["/openapi.json"] is Access.OPEN
    assert classes["/metrics"] is Access.METRICS
    assert classes["/reset_prefix_cache"] is Access.ADMIN
    for path in ("/tokenize", "/detokenize", "/v1/completions", "/v1/responses/{response_id}"):
        assert classes[path] is Access.USER
    # A route added the plain way is caught here, and refused at run time (fail closed).
    app.router.add_post("/forgotten", empty)
    assert undeclared(app) == ["POST /forgotten"]
    with pytest.raises(ValueError):  # one path, one class
        add_route(app, "GET", "/tokenize", empty, Access.OPEN)
    async with TestClient(TestServer(app)) as client:  # no key configured: all else is open
        await openai_error(await client.post("/forgotten"), 403, "permission_denied")
        assert (await client.post("/tokenize", json=TOKENIZE)).status == 200


async def test_user_routes_need_a_user_key(model_dir):
    async with serving(model_dir, api_key=[USER], admin_api_key=[ADMIN]) as (client, _):
        for path, body in (("/tokenize", TOKENIZE), ("/detokenize", {"tokens": [5, 6]})):
            await openai_error(await client.post(path, json=body), 401, "invalid_api_key")
            wrong = await client.post(path, json=body, headers=bearer("nope"))
            await openai_error(wrong, 401, "invalid_api_key")
            assert (await client.post(path, json=body, headers=bearer(USER))).status == 200
            # an admin key is accepted wherever a user's is
            assert (await client.post(path, json=body, headers=bearer(ADMIN))).status == 200
        unknown = await client.get("/no/such/route")
        await openai_error(unknown, 401, "invalid_api_key")  # learns nothing without a key
        assert (await client.get("/no/such/route", headers=bearer(USER))).status == 404
        assert (await client.get("/health")).status == 200
        assert (await client.get("/openapi.json")).status == 200
        assert (await client.get("/metrics")).status == 200  # open: no --metrics-api-key


async def test_admin_routes_take_only_admin_keys(model_dir):
    async def forget(external: bool) -> tuple[int, int]:
        return 3, 0

    async with serving(model_dir, api_key=[USER], admin_api_key=[ADMIN]) as (client, d0):
        await answer_resets(d0.bus, d0.worker_id, forget)
        await openai_error(await client.post("/reset_prefix_cache"), 401, "invalid_api_key")
        denied = await client.post("/reset_prefix_cache", headers=bearer(USER))
        assert denied.headers.get("WWW-Authenticate") is None
        assert (await denied.json())["error"]["type"] == "permission_error"
        await openai_error(denied, 403, "permission_denied")
        wrong = await client.post("/reset_prefix_cache", headers={"x-api-key": "nope"})
        await openai_error(wrong, 401, "invalid_api_key")
        done = await client.post("/reset_prefix_cache", headers={"x-api-key": ADMIN})
        assert done.status == 200, await done.text()
        assert (await done.json())["workers"]["d0"]["blocks"] == 3


async def test_api_keys_without_an_admin_key_close_the_admin_routes(model_dir):
    async with serving(model_dir, api_key=[USER]) as (client, _):
        await openai_error(await client.post("/reset_prefix_cache"), 401, "invalid_api_key")
        denied = await client.post("/reset_prefix_cache", headers=bearer(USER))
        assert "--admin-api-key" in await openai_error(denied, 403, "permission_denied")
    # With no key at all the gateway is open, the admin routes too (a local deployment);
    # here the fake worker never answers the reset, hence busy: the route was reached.
    async with serving(model_dir) as (client, _):
        assert (await client.post("/tokenize", json=TOKENIZE)).status == 200
        reached = await client.post("/reset_prefix_cache")
        await openai_error(reached, 409, "busy")


async def test_admin_key_alone_closes_only_the_admin_routes(model_dir):
    async with serving(model_dir, admin_api_key=[ADMIN]) as (client, _):
        assert (await client.post("/tokenize", json=TOKENIZE)).status == 200
        await openai_error(await client.post("/reset_prefix_cache"), 401, "invalid_api_key")


async def test_metrics_key_closes_metrics(model_dir):
    keys = {"api_key": [USER], "admin_api_key": [ADMIN], "metrics_api_key": [METRICS]}
    async with serving(model_dir, **keys) as (client, _):
        await openai_error(await client.get("/metrics"), 401, "invalid_api_key")
        denied = await client.get("/metrics", headers=bearer(USER))
        await openai_error(denied, 403, "permission_denied")
        for key in (METRICS, ADMIN):
            page = await client.get("/metrics", headers=bearer(key))
            assert page.status == 200 and "pdserve_http_requests_total" in await page.text()
        # a metrics key is no user key
        tokenize = await client.post("/tokenize", json=TOKENIZE, headers=bearer(METRICS))
        await openai_error(tokenize, 403, "permission_denied")
        assert (await client.get("/health")).status == 200


async def test_anthropic_paths_keep_anthropics_shape(model_dir):
    async with serving(model_dir, api_key=[USER], admin_api_key=[ADMIN]) as (client, _):
        denied = await client.post("/v1/messages", json=ASK, headers={"x-api-key": ADMIN + "x"})
        assert denied.status == 401
        body = await denied.json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        # a metrics-only key is a valid key without the right: Anthropic's permission_error
    async with serving(model_dir, api_key=[USER], metrics_api_key=[METRICS]) as (client, _):
        denied = await client.post("/v1/messages", json=ASK, headers={"x-api-key": METRICS})
        assert denied.status == 403
        assert (await denied.json())["error"]["type"] == "permission_error"


async def test_pdserve_ups_own_reads_of_metrics_present_the_metrics_key(model_dir):
    """Readiness, autoscaling and rollouts count the gateway's workers on /metrics: under
    --metrics-api-key they present it (services/control/launch_checks.py)."""
    async with serving(model_dir, api_key=[USER], metrics_api_key=[METRICS]) as (client, _):
        url = str(client.make_url("")).rstrip("/")
        config = GatewayConfig(api_key=[USER], metrics_api_key=[METRICS])
        assert metrics_key(config) == METRICS and metrics_key(GatewayConfig()) is None
        assert await asyncio.to_thread(registered_names, url, metrics_key(config)) == {"d0"}
        assert await asyncio.to_thread(registered_names, url) == set()  # refused: 401
