"""The gateway's side of layer-wise KV streaming (issue 29 item 3), on the in-memory bus with
scripted workers: a prefill worker's early answer (a streaming handle, no token) sends the decode
leg at once, without the first token, to a decode worker that pulls streamed KV; the first token
still reaches the client from the prefill worker's answer; without such a decode worker the
request waits for the whole prefill and pulls in bulk."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.shared.bus.request_messages import DecodeRequest, PrefillRequest, PrefillResult
from tests.bus_memory import MemoryNetwork
from tests.unit.fake_workers import FakeWorker, settle
from tests.unit.test_dispatch import Run, stack


@pytest.fixture
async def net():
    return MemoryNetwork()


async def early(prefill: FakeWorker, request: PrefillRequest) -> PrefillResult:
    """The prefill worker's answer when the prompt's last pass starts: the handle only."""
    kv = dataclasses.replace(prefill.kv(request), streaming=True)
    result = PrefillResult(request.bus_id, prefill.worker_id, None, None, kv, None)
    await prefill.bus.publish(request.reply_to, result)
    return result


async def final(prefill: FakeWorker, request: PrefillRequest, token: int, finish=None) -> None:
    kv = dataclasses.replace(prefill.kv(request), streaming=True)
    result = PrefillResult(request.bus_id, prefill.worker_id, token, finish, kv, None, 3)
    await prefill.bus.publish(request.reply_to, result)


async def test_the_decode_leg_starts_with_the_prefill_and_the_token_comes_from_it(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        await w["d0"].beat(kv_stream=True)
        await settle()
        run = Run(gw)
        pre: PrefillRequest = await w["p0"].next_request()
        assert pre.stream_kv  # a decode worker can take it
        handle = (await early(w["p0"], pre)).kv
        dec: DecodeRequest = await w["d0"].next_request()
        assert dec.kv == handle and dec.output_token_ids == []  # the pull brings the token
        await final(w["p0"], pre, 7)
        await settle()
        assert [e.token_ids for e in run.events] == [[7]]  # at once, from the prefill worker
        w["d0"].positions[(dec.bus_id, 0)] = 1  # the decode worker's tokens follow it
        await w["d0"].tokens(dec, [8])
        await w["d0"].tokens(dec, [9], "length")
        events = await run.result()
        assert [(e.token_ids, e.finish_reason) for e in events] == [
            ([7], None),
            ([8], None),
            ([9], "length"),
        ]
        assert events[0].cached_tokens == 3
        await settle()
        # the decode worker pulled the lease and lets it go: the gateway releases nothing
        assert w["p0"].released == [] and w["d0"].cancels == []


async def test_without_a_streaming_decode_worker_the_request_waits_for_all_of_it(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        pre: PrefillRequest = await w["p0"].next_request()
        assert not pre.stream_kv
        await early(w["p0"], pre)  # (a prefill worker that streams anyway: ignored)
        await settle()
        assert w["d0"].requests.empty()
        await final(w["p0"], pre, 7)
        dec: DecodeRequest = await w["d0"].next_request()
        # a complete lease now, pulled in bulk by any decode worker, the token in the request
        assert dec.output_token_ids == [7] and not dec.kv.streaming
        await w["d0"].tokens(dec, [8], "length")
        assert [e.token_ids for e in await run.result()] == [[7], [8]]


async def test_finished_at_the_first_token_cancels_the_streamed_leg(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        await w["d0"].beat(kv_stream=True)
        await settle()
        run = Run(gw, max_tokens=1)
        pre = await w["p0"].next_request()
        await early(w["p0"], pre)
        dec = await w["d0"].next_request()
        await final(w["p0"], pre, 5, finish="length")
        events = await run.result()
        assert [(e.token_ids, e.finish_reason) for e in events] == [([5], "length")]
        await settle()
        assert dec.bus_id in w["d0"].cancels


async def test_a_failed_streamed_prefill_is_the_decode_workers_to_recompute(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        await w["d0"].beat(kv_stream=True)
        await settle()
        run = Run(gw)
        pre = await w["p0"].next_request()
        await early(w["p0"], pre)
        dec = await w["d0"].next_request()
        await w["p0"].refuse(pre, code="internal", error="engine failed")
        await settle()
        assert run.events == [] and not run.task.done()  # not retried: the leg owns it
        # the pull is refused, the decode worker computes the prompt: its first token too
        await w["d0"].tokens(dec, [7])
        await w["d0"].tokens(dec, [8], "length")
        assert [e.token_ids for e in await run.result()] == [[7], [8]]
