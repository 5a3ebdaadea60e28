"""Limits per API key (``gateway/key_limits.py``): requests in flight and tokens per minute, each
refused with a 429 and ``Retry-After`` (OpenAI's shape; Anthropic's on ``/v1/messages``), and
counted in metrics by key id, never by the key. The window's arithmetic on a fake clock, then
the real app on the in-memory bus with a scripted decode worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from pdserve.gateway.access import key_id
from pdserve.gateway.errors import APIError
from pdserve.gateway.key_limits import KeyLimits
from tests.unit.anthropic_fixtures import ASK
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir

USER, OTHER = "tenant-one-key", "tenant-two-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(300), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_token_window_slides_and_says_when_to_retry():
    clock = Clock()
    limits = KeyLimits(0, 100, CollectorRegistry(), clock=clock)
    with limits.admit("k", 60) as ticket:  # within budget: admitted, the prompt charged
        clock.now += 10
        ticket.charge(50)  # 110 now: one request may carry the key past its budget
    clock.now += 5
    with pytest.raises(APIError) as refused:
        with limits.admit("k", 1):
            pass
    err = refused.value
    assert (err.status, err.type, err.code) == (429, "tokens", "rate_limit_exceeded")
    # the 60 prompt tokens charged at t=1000 leave at 1060: 45 s from now (t=1015)
    assert err.headers["Retry-After"] == "45"
    assert limits.used("k") == 110
    clock.now = 1060.0
    assert limits.used("k") == 50
    with limits.admit("k", 1):
        pass
    with limits.admit("other", 99):  # each key has its own budget
        pass
    clock.now = 1200.0
    assert limits.used("k") == 0


def test_requests_in_flight_per_key():
    limits = KeyLimits(2, 0, CollectorRegistry())
    with limits.admit("k", 5), limits.admit("k", 5):
        with pytest.raises(APIError) as refused:
            with limits.admit("k", 5):
                pass
        assert (refused.value.status, refused.value.type) == (429, "requests")
        assert refused.value.headers["Retry-After"] == "1"
        with limits.admit("other", 5):
            pass
    with limits.admit("k", 5):  # freed when they ended
        pass


def metric(page: str, name: str, **labels: str) -> float:
    """A sample's value from a Prometheus text page; 0 when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in page.splitlines():
        if line.startswith(name + "{"):
            sample, _, value = line.rpartition(" ")
            got = ",".join(sorted(sample[len(name) + 1 : -1].split(",")))
            if got == want:
                return float(value)
    return 0.0


def completion(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4}


async def test_a_key_over_its_concurrency_gets_429(model_dir, tok):
    ids = tok.encode("ok", add_special_tokens=False).ids
    limits = {"api_key": [USER, OTHER], "max_concurrent_requests_per_key": 1}
    async with serving(model_dir, **limits) as (client, d0):
        user = {"Authorization": f"Bearer {USER}"}
        held = asyncio.create_task(
            client.post("/v1/completions", json=completion("Hi"), headers=user)
        )
        first = await d0.next_request()
        refused = await client.post("/v1/completions", json=completion("Hi"), headers=user)
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        error = (await refused.json())["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        anthropic = await client.post("/v1/messages", json=ASK, headers={"x-api-key": USER})
        assert anthropic.status == 429 and anthropic.headers["Retry-After"] == "1"
        assert (await anthropic.json())["error"]["type"] == "rate_limit_error"
        other = asyncio.create_task(
            client.post("/v1/completions", json=completion("Hi"), headers={"x-api-key": OTHER})
        )
        second = await d0.next_request()  # another key is not held back
        await d0.tokens(first, ids, "stop")
        await d0.tokens(second, ids, "stop")
        assert (await held).status == 200 and (await other).status == 200
        page = await (await client.get("/metrics", headers=user)).text()
    assert USER not in page and OTHER not in page  # keys never appear, only their ids
    mine = key_id(USER)
    assert metric(page, "pdserve_key_rejected_total", key_id=mine, reason="concurrency") == 2
    assert metric(page, "pdserve_key_requests_total", key_id=mine) == 1
    assert metric(page, "pdserve_key_requests_total", key_id=key_id(OTHER)) == 1


async def test_a_key_past_its_token_budget_gets_429_until_the_window_frees(model_dir, tok):
    prompt = "The quick brown fox jumps over the lazy dog."
    prompt_tokens = len(tok.encode(prompt).ids)  # completions add the BOS
    out = tok.encode(" ok", add_special_tokens=False).ids
    async with serving(model_dir, api_key=[USER], tokens_per_minute_per_key=5) as (client, d0):
        user = {"Authorization": f"Bearer {USER}"}
        reply = asyncio.create_task(
            client.post("/v1/completions", json=completion(prompt), headers=user)
        )
        await d0.tokens(await d0.next_request(), out, "stop")
        assert (await reply).status == 200  # admitted with the budget unspent
        refused = await client.post("/v1/completions", json=completion(prompt), headers=user)
        assert refused.status == 429
        assert 50 <= int(refused.headers["Retry-After"]) <= 60
        error = (await refused.json())["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert "--tokens-per-minute-per-key" in error["message"]
        page = await (await client.get("/metrics", headers=user)).text()
    mine = key_id(USER)
    assert metric(page, "pdserve_key_tokens_total", key_id=mine, kind="prompt") == prompt_tokens
    assert metric(page, "pdserve_key_tokens_total", key_id=mine, kind="completion") == len(out)
    assert metric(page, "pdserve_key_rejected_total", key_id=mine, reason="tokens") == 1


async def test_without_keys_every_request_shares_the_anonymous_bucket(model_dir, tok):
    ids = tok.encode("ok", add_special_tokens=False).ids
    async with serving(model_dir, max_concurrent_requests_per_key=1) as (client, d0):
        held = asyncio.create_task(client.post("/v1/completions", json=completion("Hi")))
        request = await d0.next_request()
        refused = await client.post("/v1/completions", json=completion("Hi"))
        assert refused.status == 429
        await d0.tokens(request, ids, "stop")
        assert (await held).status == 200
        page = await (await client.get("/metrics")).text()
    assert metric(page, "pdserve_key_rejected_total", key_id="anonymous", reason="concurrency")


async def test_a_stream_pays_for_its_tokens_as_they_come(model_dir, tok):
    out = tok.encode(" one two three", add_special_tokens=False).ids
    assert len(out) > 2
    async with serving(model_dir, api_key=[USER], tokens_per_minute_per_key=10_000) as (
        client,
        d0,
    ):
        user = {"Authorization": f"Bearer {USER}"}
        body = {**completion("Hi"), "max_tokens": 50, "stream": True}
        reply = asyncio.create_task(client.post("/v1/completions", json=body, headers=user))
        request = await d0.next_request()
        await d0.tokens(request, out[:2])
        response = await asyncio.wait_for(reply, 10)
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
        page = await (await client.get("/metrics", headers=user)).text()
        # charged while the stream is still open, not only once it ends
        assert metric(page, "pdserve_key_tokens_total", key_id=key_id(USER), kind="completion") == 2
        await d0.tokens(request, out[2:], "stop")
        await response.read()
        page = await (await client.get("/metrics", headers=user)).text()
    assert metric(page, "pdserve_key_tokens_total", key_id=key_id(USER), kind="completion") == len(
        out
    )
