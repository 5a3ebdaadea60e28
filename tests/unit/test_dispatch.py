"""The gateway's dispatcher, worker registry and router below the real bus: scripted workers on
the in-memory bus (real protocol messages), no nats-server, no HTTP. Runs in seconds."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pdserve.gateway.inflight.delivery import TokenEvent
from pdserve.gateway.inflight.faults import NotSendable, NoWorker, StageTimeout, WorkerFailure
from pdserve.shared.bus.request_messages import DecodeRequest, PrefillRequest
from pdserve.shared.sampling import SamplingParams
from tests.bus_memory import MemoryNetwork
from tests.unit.fake_workers import FakeWorker, GatewaySide, settle

PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks of 16


@pytest.fixture
async def net():
    return MemoryNetwork()


@contextlib.asynccontextmanager
async def stack(net: MemoryNetwork, *workers: tuple[str, str], **gateway_kw):
    """A gateway side and started fake workers ((role, id), ...), all known to the registry."""
    gw = await GatewaySide(net, **gateway_kw).start()
    fakes = {}
    for role, wid in workers:
        fakes[wid] = await FakeWorker(net, role, wid).start()
    await settle()
    assert {w.worker_id for w in gw.workers.loads()} == set(fakes)
    try:
        yield gw, fakes
    finally:
        await gw.stop()
        for fake in fakes.values():
            if fake.bus.connected:
                await fake.bus.close()


class Run:
    """One request through ``Dispatcher.generate``, consumed by a task as a client would."""

    def __init__(
        self, gw: GatewaySide, prompt: list[int] = PROMPT, rid: str = "req-1", max_tokens: int = 8
    ) -> None:
        self.events: list[TokenEvent] = []
        gen = gw.dispatcher.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))
        self.gen = gen
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> list[TokenEvent]:
        async with contextlib.aclosing(self.gen) as events:
            async for event in events:
                self.events.append(event)
        return self.events

    async def result(self, timeout: float = 2.0) -> list[TokenEvent]:
        return await asyncio.wait_for(self.task, timeout)

    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]


async def test_prefill_then_decode_with_the_kv_handle(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        pre: PrefillRequest = await w["p0"].next_request()
        assert pre.prompt_token_ids == PROMPT and pre.reply_to == gw.dispatcher.inbox
        assert pre.client_id == "req-1" and pre.bus_id.startswith("req-1-")
        result = await w["p0"].prefilled(pre, first_token=7)
        dec: DecodeRequest = await w["d0"].next_request()
        assert dec.bus_id == pre.bus_id and dec.kv == result.kv
        assert dec.output_token_ids == [7] and dec.deadline >= pre.deadline
        await w["d0"].tokens(dec, [8, 9])
        await w["d0"].tokens(dec, [10], "length")
        events = await run.result()
        assert [(e.token_ids, e.finish_reason) for e in events] == [
            ([7], None),
            ([8, 9], None),
            ([10], "length"),
        ]
        assert events[0].cached_tokens == 3
        await settle()
        # Ended normally: nothing cancelled, nothing released, nothing left counted anywhere.
        assert w["p0"].cancels == w["d0"].cancels == [] and w["p0"].released == []
        assert gw.dispatcher._pending == {} and gw.router._in_decode == {}


async def test_short_prompt_or_no_prefill_worker_prefills_on_the_decode_worker(net) -> None:
    async with stack(net, ("decode", "d0")) as (gw, w):
        run = Run(gw)
        dec = await w["d0"].next_request()
        assert dec.kv is None and dec.output_token_ids == []
        await w["d0"].tokens(dec, [1], "stop")
        assert [e.finish_reason for e in await run.result()] == ["stop"]


async def test_done_at_the_first_token_releases_the_lease_and_skips_decode(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        run = Run(gw, max_tokens=1)
        pre = await w["p0"].next_request()
        await w["p0"].prefilled(pre, first_token=5, finish="length")
        events = await run.result()
        assert [(e.token_ids, e.finish_reason) for e in events] == [([5], "length")]
        await settle()
        assert w["d0"].received == [] and w["p0"].cancels == []
        assert w["p0"].released == [pre.bus_id]  # nobody will pull that KV


async def test_no_decode_worker_and_unsendable_requests_fail_before_anything_is_sent(net) -> None:
    async with stack(net, ("prefill", "p0"), max_message_bytes=2000) as (gw, w):
        with pytest.raises(NoWorker):
            await Run(gw).result()  # a prefill worker could start it, but nobody could decode
        with pytest.raises(NotSendable):
            await Run(gw, prompt=list(range(2000))).result()  # over the bus message size
        await settle()
        assert w["p0"].received == []


async def test_prefill_worker_lost_mid_request_retries_on_another(net) -> None:
    async with stack(net, ("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        await settle()
        first, other = ("p0", "p1") if w["p0"].received else ("p1", "p0")
        pre = await w[first].next_request()
        await w[first].crash()
        # Its heartbeats stop; past the timeout the registry pings, nobody answers: gone.
        await w[other].beat()
        await w["d0"].beat()
        gw.now += 31
        gw.workers.prune()
        gw.now -= 31
        retry = await w[other].next_request()
        assert retry.bus_id == pre.bus_id
        await w[other].prefilled(retry)
        dec = await w["d0"].next_request()
        assert dec.kv.worker_id == other
        await w["d0"].tokens(dec, [1], "stop")
        assert len(await run.result()) == 2


async def test_decode_worker_lost_mid_request_fails_it(net) -> None:
    async with stack(net, ("decode", "d0")) as (gw, w):
        run = Run(gw)
        dec = await w["d0"].next_request()
        await w["d0"].tokens(dec, [1, 2])
        await w["d0"].crash()
        gw.now += 31
        gw.workers.prune()
        with pytest.raises(WorkerFailure) as failure:
            await run.result()
        assert failure.value.code == "worker_lost" and run.tokens() == [1, 2]


async def test_a_late_answer_from_a_replaced_prefill_worker_is_released(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        p1 = await FakeWorker(net, "prefill", "p1").start()
        await settle()
        run = Run(gw)
        # The KV-aware router sends to one of them; the other is the fallback.
        await settle()
        first, other = (w["p0"], p1) if w["p0"].received else (p1, w["p0"])
        pre = await first.next_request()
        await first.restart()  # a new incarnation: the old one's work counts as lost
        retry = await other.next_request()
        # ...but the old incarnation answers anyway: its lease must be released, not used.
        await first.prefilled(pre, first_token=99)
        await settle()
        assert first.released == [pre.bus_id]
        await other.prefilled(retry, first_token=7)
        dec = await w["d0"].next_request()
        assert dec.kv.worker_id == other.worker_id and dec.output_token_ids == [7]
        # A prefill answer that turns up during decode (a duplicate) is released as well.
        await other.prefilled(retry, first_token=7)
        await w["d0"].tokens(dec, [8], "stop")
        assert [t for e in await run.result() for t in e.token_ids] == [7, 8]
        # After the end: late tokens are dropped, a late prefill answer frees its lease.
        await w["d0"].tokens(dec, [9], "stop")
        await first.prefilled(pre)
        await settle()
        assert other.released == [retry.bus_id]
        assert first.released == [pre.bus_id, pre.bus_id]
        assert gw.bus.stats.handler_errors == 0
        await p1.bus.close()


async def test_the_request_deadline_ends_a_silent_decode_and_cancels_it(net) -> None:
    async with stack(net, ("decode", "d0"), request_timeout=0.2) as (gw, w):
        run = Run(gw)
        dec = await w["d0"].next_request()
        await w["d0"].tokens(dec, [1])
        with pytest.raises(StageTimeout, match="decode stage"):
            await run.result()
        await settle()
        assert w["d0"].cancels == [dec.bus_id]


async def test_the_prefill_deadline_is_the_shorter_stage_deadline(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0"), prefill_timeout=0.1) as (gw, w):
        run = Run(gw)
        pre = await w["p0"].next_request()
        assert pre.deadline - time.time() <= 0.1  # not the request's 10 s
        with pytest.raises(StageTimeout, match="prefill stage"):
            await run.result()
        await settle()
        assert w["p0"].cancels == [pre.bus_id] and w["d0"].received == []


async def test_a_refused_pull_moves_the_request_to_another_decode_worker(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw)
        pre = await w["p0"].next_request()
        await w["p0"].prefilled(pre, first_token=7)
        await settle()
        first, other = (w["d0"], w["d1"]) if w["d0"].received else (w["d1"], w["d0"])
        dec = await first.next_request()
        assert dec.kv is not None
        await first.refuse(dec, "overloaded")  # it dropped the KV lease: the next one prefills
        again = await other.next_request()
        assert again.kv is None and again.output_token_ids == [7]
        await other.tokens(again, [8], "length")
        assert [e.token_ids for e in await run.result()] == [[7], [8]]


async def test_a_refusal_after_tokens_streamed_or_a_worker_error_is_a_failure(net) -> None:
    async with stack(net, ("decode", "d0"), ("decode", "d1")) as (gw, w):
        run = Run(gw)
        await settle()
        first = w["d0"] if w["d0"].received else w["d1"]
        dec = await first.next_request()
        await first.tokens(dec, [1])
        await first.refuse(dec, "overloaded")
        with pytest.raises(WorkerFailure) as failure:
            await run.result()
        assert failure.value.code == "overloaded"
        # An abort without an error message is still an error, never a short answer.
        run = Run(gw, rid="req-2")
        await settle()
        worker = w["d0"] if len(w["d0"].received) > (first is w["d0"]) else w["d1"]
        dec = await worker.next_request()
        await worker.tokens(dec, [], "abort")
        with pytest.raises(WorkerFailure):
            await run.result()


async def test_every_decode_worker_refusing_fails_with_no_worker(net) -> None:
    async with stack(net, ("decode", "d0")) as (gw, w):
        run = Run(gw)
        await w["d0"].refuse(await w["d0"].next_request(), "draining")
        with pytest.raises(NoWorker):
            await run.result()


async def test_closing_the_stream_early_cancels_on_the_workers(net) -> None:
    async with stack(net, ("decode", "d0")) as (gw, w):
        gen = gw.dispatcher.generate("req-1", PROMPT, SamplingParams(max_tokens=8))
        first = asyncio.ensure_future(gen.__anext__())
        dec = await w["d0"].next_request()
        await w["d0"].tokens(dec, [1])
        assert (await first).token_ids == [1]
        await gen.aclose()  # a stop string matched, say
        await settle()
        assert w["d0"].cancels == [dec.bus_id]
        assert gw.dispatcher._pending == {} and gw.router._in_decode == {}


async def test_a_client_gone_mid_prefill_cancels_and_frees_the_late_lease(net) -> None:
    async with stack(net, ("prefill", "p0"), ("decode", "d0")) as (gw, w):
        run = Run(gw)
        pre = await w["p0"].next_request()
        run.task.cancel()  # the HTTP handler is cancelled
        with pytest.raises(asyncio.CancelledError):
            await run.task
        await settle()
        assert w["p0"].cancels == [pre.bus_id]
        await w["p0"].prefilled(pre)  # answered anyway, before it saw the cancel
        await settle()
        assert w["p0"].released == [pre.bus_id]


async def test_trace_context_rides_in_the_headers(net) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    async with stack(net, ("decode", "d0")) as (gw, w):
        with tracer.start_as_current_span("root") as root:
            context = trace.set_span_in_context(root)
            gen = gw.dispatcher.generate("req-1", PROMPT, SamplingParams(), context)
            first = asyncio.ensure_future(gen.__anext__())
            dec = await w["d0"].next_request()
        await w["d0"].tokens(dec, [1], "stop")
        await first
        await gen.aclose()
        trace_id = format(root.get_span_context().trace_id, "032x")
        assert trace_id in w["d0"].headers[0]["traceparent"]


# ----------------------------------------------------------------------------- registry


async def test_registry_joins_leaves_restarts_and_drains(net) -> None:
    gw = await GatewaySide(net, worker_timeout=5.0).start()
    events: list[tuple[str, str]] = []
    gw.workers.add_listener(lambda event, load: events.append((event, load.worker_id)))
    d0 = await FakeWorker(net, "decode", "d0").start()
    p0 = await FakeWorker(net, "prefill", "p0").start()
    await settle()
    assert events == [("joined", "d0"), ("joined", "p0")]
    assert [w.worker_id for w in gw.router.serving("decode")] == ["d0"]
    await d0.beat(draining=True)
    await settle()
    assert gw.workers.routable("decode") == [] and not gw.router.has_decode()
    assert gw.workers.get("d0").draining  # still known: its requests go on
    await d0.restart()
    await settle()
    assert events[2:] == [("left", "d0"), ("joined", "d0")]
    await p0.leave()
    await settle()
    assert events[4:] == [("left", "p0")] and gw.workers.get("p0") is None
    await gw.stop()
    await d0.bus.close()
    await p0.bus.close()


async def test_registry_pings_a_silent_worker_before_reporting_it_gone(net) -> None:
    gw = await GatewaySide(net, worker_timeout=5.0).start()
    events: list[tuple[str, str]] = []
    gw.workers.add_listener(lambda event, load: events.append((event, load.worker_id)))
    slow = await FakeWorker(net, "decode", "slow").start()
    dead = await FakeWorker(net, "decode", "dead").start()
    await settle()
    await dead.crash()
    gw.now += 6  # both missed their heartbeats
    assert gw.workers.routable("decode") == []  # not routable while silent...
    await settle()
    # ...but only the one nobody answers for is gone; the slow one answered its ping.
    assert events[2:] == [("left", "dead")]
    assert [w.worker_id for w in gw.workers.routable("decode")] == ["slow"]
    await gw.stop()
    await slow.bus.close()


async def test_router_uses_the_registry_model_filter_and_kv_events(net) -> None:
    from pdserve.shared.discovery.announce import KVEventPublisher
    from pdserve.shared.kv.layout import prefix_block_hashes

    gw = await GatewaySide(net).start()
    other = await FakeWorker(net, "decode", "other", model="another-model").start()
    p0 = await FakeWorker(net, "prefill", "p0").start()
    p1 = await FakeWorker(net, "prefill", "p1").start()
    await settle()
    assert not gw.router.has_decode()  # a worker of another model never qualifies
    hashes = prefix_block_hashes(PROMPT, 16)
    holder = p1 if gw.router.pick_prefill([9] * 40) == "p0" else p0  # not the load's choice
    events = KVEventPublisher(
        holder.bus,
        holder.worker_id,
        holder.load.instance,
        16,
        lambda: (hashes, []),
        lambda: hashes,
        interval=60,
    )
    await events.publish_now()
    await settle()
    assert gw.workers.prefix_hits(holder.worker_id, hashes) == len(hashes)
    assert gw.router.pick_prefill(PROMPT) == holder.worker_id
    await gw.stop()
    for fake in (other, p0, p1):
        await fake.bus.close()
