"""A decode worker under ``--kv-failure-policy reprefill`` hands a failed KV pull back to the
gateway (``kv_reprefill``, issue 47): the gateway prefills the prompt again on another prefill
worker - never the one whose KV could not be pulled - and sends the first leg again with the
new KV; the client's first token is not sent twice. With no other prefill worker the leg goes
without KV (the decode worker prefills it); a leg that already streamed fails as under policy
fail. In-memory bus, scripted workers."""

from __future__ import annotations

import pytest

from pdserve.gateway.inflight.faults import WorkerFailure
from pdserve.shared.bus.request_messages import DecodeRequest, PrefillRequest
from tests.bus_memory import MemoryNetwork
from tests.unit.fake_workers import settle
from tests.unit.test_dispatch import Run, stack

FAILED = "KV transfer failed: KV pull from p timed out after 3.0s"


@pytest.fixture
async def net():
    return MemoryNetwork()


async def test_a_failed_pull_is_prefilled_again_on_the_other_prefill_worker(net) -> None:
    async with stack(net, ("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        await settle()
        first, other = (w["p0"], w["p1"]) if w["p0"].received else (w["p1"], w["p0"])
        pre: PrefillRequest = await first.next_request()
        await first.prefilled(pre, first_token=7)
        dec: DecodeRequest = await w["d0"].next_request()
        assert dec.kv is not None and dec.kv.worker_id == first.worker_id
        await w["d0"].refuse(dec, "kv_reprefill", FAILED)
        again: PrefillRequest = await other.next_request()  # not the one it failed to pull from
        assert again.prompt_token_ids == pre.prompt_token_ids
        await other.prefilled(again, first_token=7)
        dec2: DecodeRequest = await w["d0"].next_request()
        assert dec2.kv is not None and dec2.kv.worker_id == other.worker_id
        assert dec2.output_token_ids == [7]  # the client has it: the leg continues from it
        await w["d0"].tokens(dec2, [8])
        await w["d0"].tokens(dec2, [9], "length")
        events = await run.result()
        assert [e.token_ids for e in events] == [[7], [8], [9]]  # 7 once
        assert first.requests.empty()


async def test_without_another_prefill_worker_the_decode_worker_prefills_it(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        pre: PrefillRequest = await w["p0"].next_request()
        await w["p0"].prefilled(pre, first_token=7)
        dec: DecodeRequest = await w["d0"].next_request()
        await w["d0"].refuse(dec, "kv_reprefill", FAILED)
        again: DecodeRequest = await w["d0"].next_request()
        assert again.kv is None and again.output_token_ids == [7]
        assert w["p0"].requests.empty()  # p0 is not asked again
        await w["d0"].tokens(again, [8], "length")
        assert [e.token_ids for e in await run.result()] == [[7], [8]]


async def test_a_leg_that_streamed_fails_as_under_policy_fail(net) -> None:
    async with stack(net, ("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        await settle()
        first = w["p0"] if w["p0"].received else w["p1"]
        await first.prefilled(await first.next_request(), first_token=7)
        dec: DecodeRequest = await w["d0"].next_request()
        await w["d0"].tokens(dec, [8])
        await w["d0"].refuse(dec, "kv_reprefill", FAILED)
        with pytest.raises(WorkerFailure) as failure:
            await run.result()
        assert failure.value.code == "kv_transfer"
