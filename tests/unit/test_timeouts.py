"""Deadlines follow progress: a long answer that keeps streaming is never cut off, a stuck one
(no first token, silent between tokens) ends with a clear timeout and is cancelled on its
worker, and a total cap applies only where the operator sets one.

The real gateway app (HTTP, SSE, the dispatcher) and the real ``Bus`` code on the in-memory
network, with scripted decode workers that stream slowly or stall (``fake_workers.py``); the
limits are made small so that each case takes a second or two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient
from tokenizers import Tokenizer

from pdserve.gateway.app_state import GATEWAY_KEY
from pdserve.gateway.inflight.faults import StageTimeout
from pdserve.gateway.inflight.limits import WIRE_NO_DEADLINE
from pdserve.shared.config import GatewayConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.options import add_options, build
from pdserve.shared.sampling import SamplingParams
from tests.bus_memory import MemoryNetwork
from tests.unit.fake_workers import MODEL, FakeWorker, GatewaySide, settle
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir

N = 10  # tokens the scripted worker streams
BODY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": N}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # named as the fake workers' model, so the router sends it to them
    return write_model_dir(tmp_path_factory.mktemp("model") / MODEL, train_byte_level(300))


@pytest.fixture(scope="module")
def tokens(model_dir) -> list[int]:
    """What the scripted worker streams: tokens that are text each (no partial UTF-8)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(" jumps over the lazy dog and a quick brown fox", add_special_tokens=False)
    assert len(ids.ids) >= N
    return ids.ids[:N]


async def stream(client: TestClient, body: dict) -> tuple[int, list]:
    """POST a streamed completion: its status and its events (a JSON body if not 200)."""
    async with client.post("/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            return r.status, [await r.json()]
        events: list = []
        async for line in r.content:
            data = line.decode().strip().removeprefix("data: ")
            if data:
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, events


def assert_timeout_error(payload: dict, option: str) -> None:
    """OpenAI's error shape, our timeout kind, and the option that set the limit named."""
    assert set(payload) == {"error"} and set(payload["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    error = payload["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "timeout"), error
    assert option in error["message"], error


async def until(predicate, what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_slow_stream_that_keeps_moving_is_never_cut_off(model_dir, tokens) -> None:
    """10 tokens, 0.25 s apart: 2.5 s in all, 2.5 times the limits, and no total cap by
    default (the old 600 s total cut 11-minute answers off)."""
    async with serving(model_dir, stall_timeout=1.0, first_token_timeout=1.0) as (client, d0):
        started = time.monotonic()
        answer = asyncio.create_task(stream(client, BODY))
        dec = await d0.next_request()
        # the worker gets the first token's deadline, not a total one
        assert dec.deadline <= time.time() + 1.0
        await d0.trickle(dec, tokens, every=0.25)
        status, events = await asyncio.wait_for(answer, 10)
        assert time.monotonic() - started > 2.5
        assert status == 200 and events[-1] == "[DONE]"
        assert not [e for e in events[:-1] if "error" in e]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events[:-1] if e["choices"][0]["text"]) == N
        assert d0.cancels == []


async def test_a_total_cap_applies_where_the_operator_sets_one(model_dir, tokens) -> None:
    async with serving(model_dir, request_timeout=1.0, stall_timeout=1.0) as (client, d0):
        started = time.monotonic()
        answer = asyncio.create_task(stream(client, BODY))
        dec = await d0.next_request()
        trickle = asyncio.create_task(d0.trickle(dec, tokens, every=0.25))
        status, events = await asyncio.wait_for(answer, 10)
        trickle.cancel()
        assert 1.0 <= time.monotonic() - started < 2.0
        assert status == 200 and events[-1] == "[DONE]"
        assert_timeout_error(events[-2], "--request-timeout")
        await until(lambda: d0.cancels == [dec.bus_id], "the cancel")


async def test_a_stalled_stream_ends_with_a_timeout_event_and_is_cancelled(
    model_dir, tokens
) -> None:
    async with serving(model_dir, stall_timeout=0.5) as (client, d0):
        answer = asyncio.create_task(stream(client, BODY))
        dec = await d0.next_request()
        await d0.tokens(dec, tokens[:2])
        silent = time.monotonic()  # and stays so: a worker stuck mid-stream
        status, events = await asyncio.wait_for(answer, 10)
        assert 0.5 <= time.monotonic() - silent < 1.5
        assert status == 200 and events[-1] == "[DONE]"
        assert events[0]["choices"][0]["text"]  # the tokens it had went out first
        assert_timeout_error(events[-2], "--stall-timeout")
        await until(lambda: d0.cancels == [dec.bus_id], "the cancel that frees the worker")
        assert client.app[GATEWAY_KEY].admitted_count == 0


async def test_a_stalled_answer_is_a_504(model_dir, tokens) -> None:
    async with serving(model_dir, stall_timeout=0.5) as (client, d0):
        answer = asyncio.create_task(client.post("/v1/completions", json=BODY))
        dec = await d0.next_request()
        await d0.tokens(dec, tokens[:1])
        response = await asyncio.wait_for(answer, 10)
        assert response.status == 504
        assert_timeout_error(await response.json(), "--stall-timeout")
        await until(lambda: d0.cancels == [dec.bus_id], "the cancel")


async def test_no_first_token_is_a_504_and_the_worker_would_drop_it_too(model_dir) -> None:
    """Stuck in a queue: the stream has not opened, so it is a real 504."""
    async with serving(model_dir, first_token_timeout=0.5) as (client, d0):
        started = time.time()
        answer = asyncio.create_task(stream(client, BODY))
        dec = await d0.next_request()
        assert started < dec.deadline <= time.time() + 0.5
        status, (payload,) = await asyncio.wait_for(answer, 10)
        assert status == 504
        assert_timeout_error(payload, "--first-token-timeout")
        await until(lambda: d0.cancels == [dec.bus_id], "the cancel")


# -- below HTTP: the dispatcher ------------------------------------------------------------


async def consume(gw: GatewaySide, max_tokens: int = 3) -> list[int]:
    gen = gw.dispatcher.generate("req-1", list(range(1, 41)), SamplingParams(max_tokens=max_tokens))
    async with contextlib.aclosing(gen) as events:
        return [t async for event in events for t in event.token_ids]


async def test_a_migrated_stream_has_the_first_token_allowance_again() -> None:
    """The new worker prefills prompt + delivered tokens before its next token: that wait is
    judged as a first token's, not as a stall."""
    net = MemoryNetwork()
    gw = await GatewaySide(net, stall_timeout=0.3, first_token_timeout=2.0).start()
    d0 = await FakeWorker(net, "decode", "d0").start()
    d1 = await FakeWorker(net, "decode", "d1", free_blocks=10).start()  # routed to second
    await settle()
    try:
        run = asyncio.create_task(consume(gw))
        dec = await d0.next_request()
        await d0.tokens(dec, [1])
        await d0.leave()
        leg = await d1.next_request()
        assert leg.output_token_ids == [1] and leg.deadline > time.time() + 1.5
        await asyncio.sleep(0.6)  # twice the stall timeout: a long local prefill
        await d1.tokens(leg, [2, 3], "length")
        assert await asyncio.wait_for(run, 3) == [1, 2, 3]
    finally:
        await gw.stop()
        for fake in (d0, d1):
            await fake.bus.close()


async def test_with_every_limit_off_nothing_times_out_and_the_wire_takes_it() -> None:
    net = MemoryNetwork()
    gw = await GatewaySide(net, request_timeout=0, first_token_timeout=0, stall_timeout=0).start()
    d0 = await FakeWorker(net, "decode", "d0").start()
    await settle()
    try:
        run = asyncio.create_task(consume(gw))
        dec = await d0.next_request()  # it crossed the checked bus: the deadline is valid
        assert dec.deadline == WIRE_NO_DEADLINE
        await d0.tokens(dec, [1, 2, 3], "length")
        assert await asyncio.wait_for(run, 3) == [1, 2, 3]
    finally:
        await gw.stop()
        await d0.bus.close()


async def test_a_total_cap_still_bounds_a_wait_for_a_decode_worker() -> None:
    """The cap is the one limit that does not move with progress."""
    net = MemoryNetwork()
    gw = await GatewaySide(net, request_timeout=0.3, stall_timeout=5.0).start()
    d0 = await FakeWorker(net, "decode", "d0").start()
    await settle()
    try:
        run = asyncio.create_task(consume(gw, max_tokens=100))
        dec = await d0.next_request()
        assert dec.deadline <= time.time() + 0.3
        for _ in range(3):
            await d0.tokens(dec, [1])
            await asyncio.sleep(0.1)
        with pytest.raises(StageTimeout, match="--request-timeout"):
            await asyncio.wait_for(run, 3)
    finally:
        await gw.stop()
        await d0.bus.close()


# -- configuration -------------------------------------------------------------------------


def test_defaults_flags_and_env(monkeypatch) -> None:
    config = GatewayConfig()
    assert (config.request_timeout, config.first_token_timeout, config.stall_timeout) == (
        0.0,
        300.0,
        60.0,
    )
    monkeypatch.setenv("PDSERVE_STALL_TIMEOUT", "5")
    monkeypatch.setenv("PDSERVE_REQUEST_TIMEOUT", "900")
    parser = argparse.ArgumentParser()
    add_options(parser, GatewayConfig)
    config = build(GatewayConfig, parser.parse_args(["--first-token-timeout", "20"]))
    assert (config.request_timeout, config.first_token_timeout, config.stall_timeout) == (
        900.0,
        20.0,
        5.0,
    )
    assert build(GatewayConfig, parser.parse_args(["--stall-timeout", "7"])).stall_timeout == 7.0
    with pytest.raises(StartupError, match="--stall-timeout"):
        GatewayConfig(stall_timeout=-1)
