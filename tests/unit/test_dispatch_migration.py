"""Migration of requests off lost decode workers, on the gateway's side: scripted workers on the
in-memory bus (real protocol messages through the real Bus), the real registry, router and
dispatcher. What the new worker is asked to do is checked message by message; that a real
engine continues exactly from it is tested end to end in tests/integration/test_migration.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from pdserve.gateway.inflight.delivery import OpenChoices, TokenEvent
from pdserve.gateway.inflight.faults import StageTimeout, WorkerFailure
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.stream_messages import TokenBatch
from pdserve.shared.sampling import SamplingParams, choice_seed
from pdserve.shared.telemetry.metrics import GatewayMetrics
from tests.bus_memory import MemoryNetwork
from tests.unit.fake_workers import FakeWorker, GatewaySide, settle

PROMPT = list(range(1, 41))


@pytest.fixture
async def net():
    return MemoryNetwork()


@contextlib.asynccontextmanager
async def stack(net: MemoryNetwork, *workers: tuple[str, str], max_migrations: int = 3):
    gw = GatewaySide(net)
    registry = CollectorRegistry()
    gw.metrics = GatewayMetrics(registry)
    gw.dispatcher.max_migrations = max_migrations
    gw.dispatcher._migrations = gw.metrics.migrations
    await gw.start()
    fakes = {wid: await FakeWorker(net, role, wid).start() for role, wid in workers}
    await settle()
    try:
        yield gw, fakes
    finally:
        await gw.stop()
        for fake in fakes.values():
            if fake.bus.connected:
                await fake.bus.close()


class Run:
    """One request consumed as a client would; ``choices`` lets the test stop one."""

    def __init__(self, gw: GatewaySide, sampling: SamplingParams, rid: str = "req-1") -> None:
        self.events: list[TokenEvent] = []
        self.choices = OpenChoices(sampling.n)
        self.gen = gw.dispatcher.generate(rid, PROMPT, sampling, None, self.choices)
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> list[TokenEvent]:
        async with contextlib.aclosing(self.gen) as events:
            async for event in events:
                self.events.append(event)
        return self.events

    async def result(self, timeout: float = 3.0) -> list[TokenEvent]:
        return await asyncio.wait_for(self.task, timeout)

    def tokens(self, index: int = 0) -> list[int]:
        return [t for e in self.events if e.index == index for t in e.token_ids]

    def finishes(self) -> list[tuple[int, str]]:
        return [(e.index, e.finish_reason) for e in self.events if e.finish_reason]


async def send(worker: FakeWorker, dec: DecodeRequest, tokens: list[int], finish=None, index=0):
    await worker.tokens(dec, tokens, finish, index)


async def first_decode(w: dict[str, FakeWorker]) -> tuple[FakeWorker, FakeWorker, DecodeRequest]:
    """(the decode worker the router picked, the other one, its request)."""
    await settle()
    first, other = (w["d0"], w["d1"]) if w["d0"].received else (w["d1"], w["d0"])
    return first, other, await first.next_request()


def migrations(gw: GatewaySide, reason: str = "worker_lost") -> float:
    return gw.metrics.migrations.labels(reason=reason)._value.get()


async def test_a_lost_decode_worker_hands_the_stream_to_another_exactly(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0"), ("decode", "d1")) as (gw, w):
        sampling = SamplingParams(max_tokens=8, temperature=1.0, prompt_logprobs=2)
        run = Run(gw, sampling)
        pre = await w["p0"].next_request()
        seed = pre.sampling.seed
        assert seed is not None  # fixed by the gateway: the worker must not draw its own
        await w["p0"].prefilled(pre, first_token=7)
        first, other, dec = await first_decode(w)
        assert dec.bus_id == pre.bus_id and dec.kv is not None
        await send(first, dec, [8, 9])
        await settle()
        await first.crash()  # kill -9: silence; the registry pings, nobody answers
        gw.now += 31
        gw.workers.prune()
        again = await other.next_request()
        # A fresh bus id; everything delivered goes along; the new worker prefills it locally.
        assert again.bus_id != dec.bus_id and again.client_id == "req-1"
        assert again.kv is None and again.output_token_ids == [7, 8, 9]
        assert again.prompt_token_ids == PROMPT and again.deadline == dec.deadline
        assert again.sampling.seed == seed and again.sampling.n == 1
        assert again.sampling.prompt_logprobs is None  # the client has them from the prefill
        assert dataclasses.replace(again.sampling, prompt_logprobs=2) == pre.sampling
        # Late tokens under the old id (a worker not so dead after all) never reach the client.
        await send(other, dec, [66], "length")
        await send(other, again, [10, 11])
        await send(other, again, [12, 13, 14], "length")
        events = await run.result()
        assert run.tokens() == [7, 8, 9, 10, 11, 12, 13, 14]
        assert run.finishes() == [(0, "length")]
        assert [e.cached_tokens for e in events] == [3, None, None, None]
        await settle()
        assert migrations(gw) == 1
        assert dec.bus_id in other.cancels  # so a worker not really gone frees its blocks
        assert gw.dispatcher._pending == {} and gw.router._in_decode == {}
        assert gw.router._decoding == {}


async def test_a_clean_departure_migrates_too_and_a_greedy_request_keeps_no_seed(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=4, temperature=0.0))
        first, other, dec = await first_decode(w)
        assert dec.sampling.seed is None and dec.kv is None and dec.output_token_ids == []
        await send(first, dec, [1, 2])
        await settle()
        await first.leave()  # WorkerGone (drain ran out, say)
        again = await other.next_request()
        assert again.output_token_ids == [1, 2]
        await send(other, again, [3, 4], "length")
        await run.result()
        assert run.tokens() == [1, 2, 3, 4]


async def test_lost_before_its_first_token_the_request_moves_and_reports_its_cache_once(
    net,
) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=2, seed=5))
        first, other, dec = await first_decode(w)
        await first.leave()
        again = await other.next_request()
        assert again.output_token_ids == [] and again.sampling == dec.sampling
        item = dataclasses.replace(other.item(again, [4]), cached_tokens=16)
        await other.bus.publish(again.reply_to, TokenBatch([item]))
        await send(other, again, [5], "length")
        events = await run.result()
        assert [e.cached_tokens for e in events] == [16, None]


async def test_two_losses_migrate_twice_and_the_limit_ends_the_stream_cleanly(net) -> None:
    workers = [("decode", "d0"), ("decode", "d1"), ("decode", "d2")]
    async with stack(net, *workers, max_migrations=2) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=9, seed=1))
        await settle()
        order = [wid for wid in w if w[wid].received]
        dec = await w[order[0]].next_request()
        delivered = []
        for hop in range(3):
            worker = w[order[-1]]
            await send(worker, dec, [hop])
            delivered.append(hop)
            await settle()
            await worker.leave()
            if hop == 2:
                break
            await settle()
            order.append(next(x for x in w if x not in order))
            dec = await w[order[-1]].next_request()
            assert dec.output_token_ids == delivered
        with pytest.raises(WorkerFailure) as failure:
            await run.result()
        assert failure.value.code == "worker_lost"
        assert "migrated 2 time(s) already (--max-migrations 2)" in str(failure.value)
        assert run.tokens() == [0, 1, 2] and migrations(gw) == 2


async def test_no_live_decode_worker_or_no_migrations_allowed_is_todays_error(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1"), max_migrations=0) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=9))
        first, other, dec = await first_decode(w)
        await send(first, dec, [1])
        await settle()
        await first.leave()
        with pytest.raises(WorkerFailure, match="max-migrations 0") as failure:
            await run.result()
        assert failure.value.code == "worker_lost" and other.received == []
    async with stack(net, ("decode", "d0")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=9))
        dec = await w["d0"].next_request()
        await send(w["d0"], dec, [1])
        await settle()
        await w["d0"].leave()
        with pytest.raises(WorkerFailure, match="no live decode worker") as failure:
            await run.result()
        assert failure.value.code == "worker_lost" and migrations(gw) == 0


async def test_a_migrated_leg_refused_before_its_first_token_moves_on(net) -> None:
    workers = [("decode", "d0"), ("decode", "d1"), ("decode", "d2")]
    async with stack(net, *workers) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=3, seed=2))
        await settle()
        first = next(x for x in w.values() if x.received)
        dec = await first.next_request()
        await send(first, dec, [1])
        await settle()
        await first.leave()
        await settle()
        second = next(x for x in w.values() if x is not first and x.received)
        again = await second.next_request()
        await second.refuse(again, "overloaded")
        await settle()
        third = next(x for x in w.values() if x not in (first, second))
        last = await third.next_request()
        assert last.bus_id == again.bus_id and last.output_token_ids == [1]
        await send(third, last, [2, 3], "length")
        await run.result()
        assert run.tokens() == [1, 2, 3] and migrations(gw) == 1


async def test_n_choices_migrate_as_one_request_each_with_its_seed(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        sampling = SamplingParams(max_tokens=4, seed=11, n=3, logprobs=1)
        run = Run(gw, sampling)
        first, other, dec = await first_decode(w)
        await send(first, dec, [10], index=0)
        await send(first, dec, [20, 21], index=1)
        await send(first, dec, [30, 31, 32, 33], "length", index=2)  # done: not migrated
        await settle()
        await first.leave()
        await settle()
        legs = {}
        for _ in range(2):
            leg = await other.next_request()
            legs[leg.output_token_ids[0] // 10 - 1] = leg
        assert set(legs) == {0, 1}
        for index, leg in legs.items():
            assert leg.sampling.n == 1 and leg.sampling.seed == choice_seed(11, index)
            assert leg.sampling.logprobs == 1 and leg.kv is None
        assert legs[0].output_token_ids == [10] and legs[1].output_token_ids == [20, 21]
        assert len({legs[0].bus_id, legs[1].bus_id, dec.bus_id}) == 3
        # Their items say choice 0: the gateway maps each back to its choice.
        await send(other, legs[1], [22])
        await settle()
        run.choices.stop(1)  # a stop string in choice 1's text: its leg is cancelled whole
        await settle()
        assert legs[1].bus_id in other.cancels  # (cancels are broadcast)
        assert legs[0].bus_id not in other.cancels
        await send(other, legs[1], [23], "length")  # under way before the cancel: dropped
        await send(other, legs[0], [11, 12, 13], "length")
        await run.result()
        assert run.tokens(0) == [10, 11, 12, 13] and run.tokens(1) == [20, 21, 22]
        assert run.tokens(2) == [30, 31, 32, 33]
        assert sorted(run.finishes()) == [(0, "length"), (2, "length")]
        await settle()
        assert gw.dispatcher._pending == {} and gw.router._in_decode == {}


async def test_n_choices_before_any_fork_migrate_as_the_whole_request(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=4, seed=3, n=2))
        pre = await w["p0"].next_request()
        await w["p0"].prefilled(pre, first_token=7)
        first, other, dec = await first_decode(w)
        await first.leave()  # before the pull: choice 1 was never forked
        again = await other.next_request()
        assert again.sampling == dec.sampling and again.sampling.n == 2
        assert again.output_token_ids == [7] and again.kv is None
        await send(other, again, [8, 9, 10], "length", index=0)
        await send(other, again, [1, 2, 3, 4], "length", index=1)
        await run.result()
        assert run.tokens(0) == [7, 8, 9, 10] and run.tokens(1) == [1, 2, 3, 4]


async def test_a_worker_back_after_a_partition_gets_the_cancels_it_missed(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw, SamplingParams(max_tokens=3, seed=6))
        first, other, dec = await first_decode(w)
        await send(first, dec, [1])
        await settle()
        # A partition: nothing reaches it (its pings neither), and it says nothing.
        cut = [s for s in list(net._subs) if s.client is first.bus.nc]
        for sub in cut:
            net._remove(sub)
        gw.now += 31
        gw.workers.prune()
        again = await other.next_request()
        await settle()
        assert first.cancels == []  # the cancel of the abandoned leg could not reach it
        for sub in cut:
            net._add(sub)
        await first.beat()  # back: the registry sees it join again
        await settle()
        assert first.cancels == [dec.bus_id]
        await send(other, again, [2, 3], "length")
        await run.result()


async def test_the_migration_is_an_event_on_the_request_span(net) -> None:
    tracer = TracerProvider().get_tracer("test")
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        with tracer.start_as_current_span("root") as root:
            context = trace.set_span_in_context(root)
            gen = gw.dispatcher.generate("req-1", PROMPT, SamplingParams(seed=1), context)
            consume = asyncio.ensure_future(gen.__anext__())
            first, other, dec = await first_decode(w)
            await send(first, dec, [1, 2])
            await consume
            consume = asyncio.ensure_future(gen.__anext__())
            await first.leave()
            again = await other.next_request()
            await send(other, again, [3], "stop")
            event = await consume
            await gen.aclose()
        (migration,) = [e for e in root.events if e.name == "pdserve.migration"]
        assert dict(migration.attributes) == {
            "pdserve.migration.reason": "worker_lost",
            "pdserve.migration.from_workers": (first.worker_id,),
            "pdserve.migration.to_workers": (other.worker_id,),
            "pdserve.migration.delivered_tokens": 2,
            "pdserve.migration.count": 1,
        }
        assert event.token_ids == [3]


async def test_a_bus_that_stays_down_ends_a_migration_at_the_deadline(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        gw.dispatcher.request_timeout = 0.3
        run = Run(gw, SamplingParams(max_tokens=5, seed=1))
        first, other, dec = await first_decode(w)
        await send(first, dec, [1])
        await settle()
        gw.bus.nc._closed = True  # the gateway's connection is down and stays down
        await first.leave()
        with pytest.raises(StageTimeout):
            await run.result()
        assert other.received == []
        gw.bus.nc._closed = False
