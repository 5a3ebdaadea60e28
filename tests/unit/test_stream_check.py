"""Token positions, replays and stream checks (``gateway/inflight/stream_check.py``,
``shared/bus/replay.py``) below the real bus: a NATS blip migrates only the streams whose tokens
are really gone. Scripted workers on the in-memory bus (real protocol messages), the real
registry, router and dispatcher; tokens "lost on the bus" are items a worker counts but never
sends (``FakeWorker.lose``). The same against real processes and a real nats-server restart:
tests/integration/test_migration.py."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.inflight import stream_check
from pdserve.gateway.inflight.stream_check import is_answer, offset
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.config import BusConfig
from pdserve.shared.sampling import SamplingParams
from tests.bus_memory import MemoryBus, MemoryNetwork
from tests.unit.fake_workers import FakeWorker, settle
from tests.unit.test_dispatch_migration import Run, first_decode, migrations, stack


@pytest.fixture
async def net():
    return MemoryNetwork()


async def resent(*workers: FakeWorker, timeout: float = 2.0) -> tuple[FakeWorker, DecodeRequest]:
    """The worker a migrated leg went to (the old one may be live: the router may pick it)."""
    tasks = {asyncio.ensure_future(w.requests.get()): w for w in workers}
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when="FIRST_COMPLETED")
    for task in pending:
        task.cancel()
    assert done, "no decode request was re-sent"
    task = done.pop()
    return tasks[task], task.result()


def test_an_item_continues_a_choice_only_at_the_count_delivered() -> None:
    delivered = {0: [5, 6, 7], 1: []}

    def at(index: int, position: int, open_choices=frozenset({0, 1})) -> int:
        return offset(
            index, TokenItem("r", [9], index=index, position=position), open_choices, delivered
        )

    assert at(0, 3) == 0 and at(0, 5) == 2 and at(0, 1) == -2  # next, a gap, a repeat
    assert at(1, 0) == 0 and at(1, 1) == 1
    assert at(2, 0, {0, 1, 2}) == 0  # forked, nothing delivered yet
    assert at(1, 4, {0}) == 0  # the consumer ended it: it is held to nothing
    assert is_answer(TokenItem("r", [], position=3))
    assert not is_answer(TokenItem("r", [], "length", position=3))
    assert not is_answer(TokenItem("r", [], "error", "gone", "unknown"))
    assert not is_answer(TokenItem("r", [4], position=3))


async def test_a_gap_the_worker_fills_again_moves_nothing(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=6, seed=3, logprobs=1))
        first, other, dec = await first_decode(w)
        await first.tokens(dec, [1, 2])
        first.lose(dec, [3])
        await first.tokens(dec, [4])  # position 3: token 3 never came, so it is checked
        check = await first.next_check()
        await first.tokens(dec, [5])  # dropped meanwhile: the replay brings it again
        await first.answer(check, replay=True)  # everything again: what the client has too
        await first.tokens(dec, [6], "length")
        await run.result()
        assert run.tokens() == [1, 2, 3, 4, 5, 6] and run.finishes() == [(0, "length")]
        assert migrations(gw, "bus_reconnect") == 0 and first.received == [dec]
        assert other.received == [] and first.cancels == []


async def test_a_gap_the_worker_cannot_fill_migrates_from_what_was_delivered(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=6, seed=3))
        first, other, dec = await first_decode(w)
        await first.tokens(dec, [1, 2])
        first.lose(dec, [3])
        await first.tokens(dec, [4])
        await first.answer(await first.next_check())  # at 4, with 2 delivered: gone
        worker, again = await resent(first, other)
        assert again.output_token_ids == [1, 2] and again.bus_id != dec.bus_id
        assert dec.bus_id in first.cancels
        await worker.tokens(again, [3, 4, 5, 6], "length")
        await run.result()
        assert run.tokens() == [1, 2, 3, 4, 5, 6]
        assert migrations(gw, "bus_reconnect") == 1 and migrations(gw) == 0


async def test_after_a_reconnect_streams_without_a_gap_go_on_and_one_with_a_gap_moves(
    net,
) -> None:
    workers = [("prefill", "p0"), ("decode", "d0"), ("decode", "d1")]
    async with stack(net, *workers) as (gw, w):
        whole = Run(gw, SamplingParams(max_tokens=6, seed=4), rid="whole")
        pre = await w["p0"].next_request()
        await w["p0"].prefilled(pre, first_token=1)
        first, other, dec = await first_decode(w)
        await first.tokens(dec, [2])
        gapped = Run(gw, SamplingParams(max_tokens=3, seed=5), rid="gapped")
        pre2 = await w["p0"].next_request()
        await w["p0"].prefilled(pre2, first_token=7)
        await settle()
        dec2 = await other.next_request()  # the router spreads them
        prefilling = Run(gw, SamplingParams(max_tokens=2, seed=6), rid="prefilling")
        pre3 = await w["p0"].next_request()
        await gw.bus.nc.reconnect()  # what was published while it was down may be lost
        await settle()
        # Every stream under way is checked where it runs; neither worker sent anything since.
        checks = {first: await first.next_check(), other: await other.next_check()}
        assert {c.bus_id for c in checks.values()} == {dec.bus_id, dec2.bus_id}
        await first.tokens(dec, [3])  # under way behind the check: it still counts
        await first.answer(checks[first])
        other.lose(dec2, [8])
        await other.tokens(dec2, [9], "length")  # past a gap: dropped, the answer decides
        await other.answer(checks[other])  # without a replay: token 8 is gone
        # The prefill, maybe lost too, is retried, and the gapped stream re-sent, where a
        # worker was heard since: only `first` was, so it prefills the one and takes the other.
        gw.now += 1
        await first.beat()
        sent = {r.client_id: r for r in [await first.next_request() for _ in "12"]}
        local, again = sent["prefilling"], sent["gapped"]
        assert local.kv is None and local.bus_id == pre3.bus_id
        assert again.output_token_ids == [7] and again.bus_id != dec2.bus_id
        await first.tokens(again, [8, 9], "length")
        await first.tokens(dec, [4, 5, 6], "length")
        await first.tokens(local, [9, 9], "length")
        await whole.result()
        await gapped.result()
        await prefilling.result()
        assert whole.tokens() == [1, 2, 3, 4, 5, 6] and gapped.tokens() == [7, 8, 9]
        assert prefilling.tokens() == [9, 9]
        assert migrations(gw, "bus_reconnect") == 1 and migrations(gw) == 0
        assert dec.bus_id not in first.cancels


@pytest.mark.parametrize("replayed", [True, False])
async def test_a_stream_that_lost_its_end_is_found_by_the_check(net, replayed) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=3, temperature=0.0))
        first, other, dec = await first_decode(w)
        await first.tokens(dec, [1])
        first.lose(dec, [2, 3], "length")  # with the finish: nothing would ever follow
        await gw.bus.nc.reconnect()
        check = await first.next_check()
        await first.answer(check, replay=replayed, forgot=True)  # over there: "unknown"
        gw.now += 1  # a migration goes to a worker heard since our reconnect
        await other.beat()
        if not replayed:
            worker, again = await resent(first, other)
            assert again.output_token_ids == [1]
            await worker.tokens(again, [2, 3], "length")
        await run.result()
        assert run.tokens() == [1, 2, 3] and run.finishes() == [(0, "length")]
        assert migrations(gw, "bus_reconnect") == (0 if replayed else 1)


async def test_an_unanswered_check_is_asked_again_then_the_stream_moves(net, monkeypatch) -> None:
    monkeypatch.setattr(stream_check, "CHECK_RETRY_SECONDS", 0.02)
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        gw.workers.timeout = 0.05  # the check gives up after CHECK_TIMEOUTS of these
        run = Run(gw, SamplingParams(max_tokens=3, seed=1))
        first, other, dec = await first_decode(w)
        await first.tokens(dec, [1])
        await gw.bus.nc.reconnect()
        gw.now += 1
        await other.beat()
        # its subscription was not back yet, say: asked again until the window closes
        assert {(await first.next_check()).bus_id for _ in range(3)} == {dec.bus_id}
        worker, again = await resent(first, other)
        assert worker is other and again.output_token_ids == [1]
        await worker.tokens(again, [2, 3], "length")
        await run.result()
        assert run.tokens() == [1, 2, 3] and migrations(gw, "bus_reconnect") == 1


async def test_a_worker_that_reconnected_has_only_its_streams_checked(net) -> None:
    workers = [("prefill", "p0"), ("decode", "d0"), ("decode", "d1")]
    async with stack(net, *workers) as (gw, w):
        runs = [Run(gw, SamplingParams(max_tokens=3, seed=i), rid=f"r{i}") for i in (1, 2)]
        for _ in runs:
            await w["p0"].prefilled(await w["p0"].next_request(), first_token=1)
        await settle()
        decs = {wid: await w[wid].next_request() for wid in ("d0", "d1")}
        for wid, dec in decs.items():
            await w[wid].tokens(dec, [2])
        prefilling = Run(gw, SamplingParams(max_tokens=2, seed=3), rid="prefilling")
        await w["p0"].next_request()
        await w["d0"].reconnected()  # WorkerGone(rejoining=True): not gone
        await w["p0"].reconnected()
        await settle()
        assert {load.worker_id for load in gw.workers.loads()} == {"p0", "d0", "d1"}
        check = await w["d0"].next_check()
        assert check.bus_id == decs["d0"].bus_id and w["d1"].checks.empty()
        await w["d0"].answer(check)
        # The prefill is retried (its request or answer may be lost), not on p0 again: there
        # is no other prefill worker, so a decode worker prefills it.
        worker, local = await resent(w["d0"], w["d1"])
        assert local.client_id == "prefilling" and local.kv is None
        for wid, dec in decs.items():
            await w[wid].tokens(dec, [3], "length")
        await worker.tokens(local, [5, 6], "length")
        for run in (*runs, prefilling):
            await run.result()
        assert [run.tokens() for run in runs] == [[1, 2, 3], [1, 2, 3]]
        assert migrations(gw, "bus_reconnect") == 0 and migrations(gw) == 0


async def test_silence_is_judged_only_while_our_connection_is_up(net) -> None:
    async with stack(net, ("decode", "d0")) as (gw, w):
        registry = gw.workers
        gw.bus.nc._closed = True  # we hear nobody now
        gw.now += 100
        registry.prune()
        assert "d0" in registry.entries
        gw.bus.nc._closed = False
        await gw.bus.nc.reconnect()  # silence counts from here
        registry.prune()
        assert "d0" in registry.entries
        gw.now += registry.timeout + 1
        registry.prune()  # silent since our reconnect: pinged...
        gw.bus.nc._closed = True  # ...while our connection breaks again: no verdict
        await settle()
        assert "d0" in registry.entries and "d0" not in registry.suspects
        gw.bus.nc._closed = False
        await w["d0"].crash()
        registry.prune()
        await settle()
        assert registry.loads() == []  # now the ping says nobody is there


async def test_the_bus_holds_replayable_messages_while_down_and_sends_them_again(net) -> None:
    """The window goes out again after a reconnect, then what was held, in order; a receiver
    that asks gets its subject's window once; anything else published while down is dropped."""
    sender = MemoryBus(BusConfig(namespace="t"), "d0", network=net)
    receiver = MemoryBus(BusConfig(namespace="t"), "gw", network=net)
    await sender.connect()
    await receiver.connect()
    got: list[int] = []

    async def on_batch(msg: TokenBatch, headers) -> None:
        got.extend(item.position for item in msg.items)

    await receiver.subscribe("t.gw.a", on_batch, (TokenBatch,))

    def batch(position: int) -> TokenBatch:
        return TokenBatch([TokenItem("r", [position], position=position)])

    await sender.publish("t.gw.a", batch(0), replayable=True)
    await sender.publish("t.gw.b", batch(100), replayable=True)  # another gateway's
    await settle()
    await sender._disconnected_cb()  # the connection broke
    await sender.publish("t.gw.a", batch(1), replayable=True)  # held
    await sender.publish(sender.subjects.cancel, Cancel("x"))  # dropped
    await settle()
    assert got == [0] and sender.stats.dropped == 1
    await sender.nc.reconnect()
    await settle()
    assert got == [0, 0, 1]  # what may have gone into the dead connection, then the rest
    assert await sender.replay("t.gw.a") == 2 and await sender.replay("t.gw.a") == 0
    await sender.publish("t.gw.a", batch(2), replayable=True)
    assert await sender.replay("t.gw.a") == 1  # only what came after the last ask
    await settle()
    assert got == [0, 0, 1, 0, 1, 2, 2]
    await sender.close()
    await receiver.close()
