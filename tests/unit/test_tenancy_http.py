"""cache_salt and priority over HTTP on every generation endpoint (a gateway app over the
in-memory bus, a scripted decode worker): what salt the worker gets - by key, by the client's
salt, never the key itself - and fcfs refusing a non-zero priority with a 400 naming it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.gateway.tenancy import request_salt
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir
from tests.unit.memory_store import MemoryResponseStore

KEYS = ["key-a", "key-b"]
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hello there", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2,
    },
    "/v1/messages": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2,
    },
    "/v1/responses": {"model": MODEL, "input": "hello there", "max_output_tokens": 2},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(300), max_position_embeddings=4096)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def salt_sent(client, d0, path: str, key: str, **extra) -> str | None:
    """POST to ``path`` with ``key``; the cache salt the decode worker got."""
    body = (
        {**BODIES[path], **extra, "store": False}
        if path == "/v1/responses"
        else {**BODIES[path], **extra}
    )
    reply = asyncio.create_task(client.post(path, json=body, headers=auth(key)))
    request = await d0.next_request()
    await d0.tokens(request, [5, 6], "stop")
    response = await asyncio.wait_for(reply, 10)
    assert response.status == 200, await response.text()
    return request.sampling.cache_salt


@pytest.mark.parametrize("path", list(BODIES))
async def test_every_endpoint_salts_by_key_and_cache_salt(model_dir, path):
    store = MemoryResponseStore()
    async with serving(model_dir, response_store=store, api_key=KEYS) as (client, d0):
        assert await salt_sent(client, d0, path, "key-a") == request_salt("key", "key-a", None)
        assert await salt_sent(client, d0, path, "key-b") == request_salt("key", "key-b", None)
        got = await salt_sent(client, d0, path, "key-a", cache_salt="t1")
        assert got == request_salt("key", "key-a", "t1") and "key-a" not in got
        response = await client.post(
            path, json={**BODIES[path], "priority": 1}, headers=auth("key-a")
        )
        error = (await response.json())["error"]
        assert response.status == 400 and "scheduling-policy" in error["message"], error
        assert d0.requests.empty()  # refused before anything was sent


async def test_global_scope_salts_by_the_clients_salt_alone(model_dir):
    async with serving(model_dir, api_key=KEYS, prefix_cache_scope="global") as (client, d0):
        path = "/v1/completions"
        assert await salt_sent(client, d0, path, "key-a") is None
        a = await salt_sent(client, d0, path, "key-a", cache_salt="shared")
        b = await salt_sent(client, d0, path, "key-b", cache_salt="shared")
        assert a == b == request_salt("global", "", "shared")
