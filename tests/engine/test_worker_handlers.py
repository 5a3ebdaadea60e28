"""Both workers' message handlers on the in-memory bus, with real engines and a KV "transfer"
that copies between the two engines' caches under the prefill worker's real lease table: the
whole request path of tests/integration/test_workers.py in one process, without nats-server or
UCX. Worker loss mid-request, late duplicates, deadlines, refused pulls and cancellation."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from pdserve.services.decode.rank_pull import RankPuller
from pdserve.services.decode.worker import DecodeWorker
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.prefill.worker import PrefillWorker
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import StreamCheck, TokenBatch, TokenItem
from pdserve.shared.config import BusConfig, EngineConfig
from pdserve.shared.kv.transfer import KVTransferError, TransferStats
from pdserve.shared.sampling import SamplingParams
from tests.bus_memory import MemoryBus, MemoryNetwork

NS = "t"
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [list(range(5, 45)), [7, 300, 12, 99, 45, 45, 45, 2]]
BLOCKS = 16


@pytest.fixture(scope="module")
def engines(llama_dir) -> dict[str, LLMEngine]:
    cfg = EngineConfig(
        model=str(llama_dir), dtype="float64", num_kv_blocks=BLOCKS, max_num_batched_tokens=256
    )
    return {
        "p0": LLMEngine(cfg, prefill_only=True),
        "d0": LLMEngine(cfg),
        "d1": LLMEngine(cfg, kv_failure_policy="recompute"),
    }


@pytest.fixture(scope="module")
def expected(engines) -> list[list[int]]:
    return engines["d0"].generate(PROMPTS, GREEDY)


class CopyKV:
    """The decode worker's KVClient, minus UCX: a pull copies blocks out of the prefill
    engine's cache, refused as the real server refuses (no lease, unreachable worker)."""

    def __init__(self, decode: LLMEngine, prefills: dict[str, PrefillWorker]) -> None:
        self.decode, self.prefills = decode, prefills
        self.gate: asyncio.Event | None = None  # set: pulls wait for it
        self.started = asyncio.Event()
        self.layer_views = None  # no layer pieces: this decode worker pulls in bulk

    def check(self, handle: KVHandle) -> None:
        pass

    async def pull(self, bus_id, handle: KVHandle, dst, timeout, address=None, heads=None):
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        worker = self.prefills.get(handle.worker_id)
        if worker is None:
            raise KVTransferError(f"{handle.worker_id} is unreachable")
        lease = worker.leases.get(bus_id)
        if lease is None or lease.token != handle.token:
            raise KVTransferError(f"{handle.worker_id} has no lease for {bus_id}")
        for s, d in zip(lease.block_ids, dst, strict=False):
            self.decode.kv_cache[d].copy_(worker.engine.kv_cache[s])
        block = self.decode.kv_cache[0]
        return TransferStats(len(dst) * block.numel() * block.element_size(), len(dst), 1, 0.0)

    async def connect(self, address) -> None:
        pass

    def disconnect(self, address) -> None:
        pass

    async def close(self) -> None:
        pass


class Gateway:
    """The gateway's side of the protocol: an inbox, and one queue of answers per request."""

    def __init__(self, net: MemoryNetwork) -> None:
        self.bus = MemoryBus(BusConfig(namespace=NS), "gw", network=net)
        self.inbox = self.bus.subjects.gateway("tg")
        self.queues: dict[str, asyncio.Queue] = {}

    async def start(self) -> None:
        await self.bus.connect()
        await self.bus.subscribe(self.inbox, self._on_message, (PrefillResult, TokenBatch))

    async def _on_message(self, msg, headers) -> None:
        items = [msg] if isinstance(msg, PrefillResult) else msg.items
        for item in items:
            self.queue(item.bus_id).put_nowait(item)

    def queue(self, rid: str) -> asyncio.Queue:
        return self.queues.setdefault(rid, asyncio.Queue())

    async def prefill(self, rid, prompt, sp=GREEDY, **kw) -> PrefillResult:
        req = PrefillRequest(rid, prompt, sp, self.inbox, time.time() + 30)
        await self.bus.publish(self.bus.subjects.prefill("p0"), replace(req, **kw))
        return await asyncio.wait_for(self.queue(rid).get(), 10)

    async def send_decode(self, worker, rid, prompt, output, kv, sp=GREEDY, **kw) -> None:
        req = DecodeRequest(rid, prompt, output, sp, kv, self.inbox, time.time() + 30)
        await self.bus.publish(self.bus.subjects.decode(worker), replace(req, **kw))

    async def items(self, rid: str) -> list[TokenItem]:
        out: list[TokenItem] = []
        while not out or out[-1].finish_reason is None:
            out.append(await asyncio.wait_for(self.queue(rid).get(), 10))
        return out

    async def decode(self, worker, rid, prompt, output, kv, **kw) -> list[TokenItem]:
        await self.send_decode(worker, rid, prompt, output, kv, **kw)
        return await self.items(rid)

    async def cancel(self, rid: str) -> None:
        await self.bus.publish(self.bus.subjects.cancel, Cancel(rid))


class Stack:
    def __init__(self, engines: dict[str, LLMEngine]) -> None:
        self.net = MemoryNetwork()
        self.gw = Gateway(self.net)
        opts = {"heartbeat_seconds": 0.1, "lease_seconds": 5.0, "drain_seconds": 1.0}
        self.prefills: dict[str, PrefillWorker] = {}
        self.workers = {
            "p0": PrefillWorker({**opts, "worker_id": "p0"}, self._bus("p0")),
            "d0": DecodeWorker({**opts, "worker_id": "d0"}, self._bus("d0")),
            "d1": DecodeWorker(
                {**opts, "worker_id": "d1", "kv_failure_policy": "recompute"}, self._bus("d1")
            ),
        }
        for wid, worker in self.workers.items():
            worker.engine = engines[wid]
            worker.start_extra = _nothing  # no UCX: the fakes below stand in
        self.prefills["p0"] = p0 = self.workers["p0"]
        p0.kv_server = _FakeServer()
        self.kv = {d: CopyKV(engines[d], self.prefills) for d in ("d0", "d1")}
        for d, client in self.kv.items():
            self.workers[d].kv_client = client
            self.workers[d].puller = RankPuller(client, None, engines[d].model_config.num_kv_heads)

    def _bus(self, wid: str) -> MemoryBus:
        return MemoryBus(BusConfig(namespace=NS), wid, network=self.net)

    async def start(self) -> None:
        await self.gw.start()
        for worker in self.workers.values():
            await worker.start()

    async def stop(self) -> None:
        for worker in self.workers.values():
            await worker.drain_and_close()
        await self.gw.bus.close()

    async def idle(self, *wids: str, timeout: float = 5.0) -> None:
        """Every block of these workers back on the free list, no request or lease left."""

        def done(w) -> bool:
            s = w.engine.stats()
            leases = len(getattr(w, "leases", ()))
            return (
                s.free_blocks == s.total_blocks
                and not (s.running or s.waiting)
                and not (w.states or leases)
            )

        deadline = time.monotonic() + timeout
        while not all(done(self.workers[w]) for w in wids):
            assert time.monotonic() < deadline, {w: self.workers[w].engine.stats() for w in wids}
            await asyncio.sleep(0.01)


async def _nothing() -> None:
    pass


class _FakeServer:
    address = "ucx1:00:AA=="

    async def stop(self) -> None:
        pass


@pytest.fixture
async def stack(engines):
    s = Stack(engines)
    await s.start()
    yield s
    await s.stop()
    for engine in engines.values():  # the next test starts from an empty cache
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks, stats


def tokens(items: list[TokenItem]) -> list[int]:
    return [t for item in items for t in item.token_ids]


async def test_prefill_pull_decode_matches_local_generation(stack, expected) -> None:
    gw = stack.gw
    for i, prompt in enumerate(PROMPTS):
        result = await gw.prefill(f"ok-{i}", prompt)
        assert result.error is None and result.kv.num_tokens == len(prompt)
        items = await gw.decode("d0", f"ok-{i}", prompt, [result.first_token], result.kv)
        assert [result.first_token] + tokens(items) == expected[i]
        assert items[-1].finish_reason == "length"
    local = await gw.decode("d1", "local", PROMPTS[0], [], None)  # prefilled on the decode side
    assert tokens(local) == expected[0]
    await stack.idle("p0", "d0", "d1")  # leases released by the decode side after the pull


async def test_prefill_worker_lost_mid_request(stack, expected) -> None:
    """The prefill worker dies between its answer and the pull: the fail policy answers with
    an error, the recompute policy with the right tokens; no block stays taken."""
    gw = stack.gw
    results = [await gw.prefill(f"lost-{i}", PROMPTS[1]) for i in range(2)]
    p0 = stack.workers["p0"]
    await p0.bus.nc.crash()  # gone without a word
    del stack.prefills["p0"]
    failed = await gw.decode("d0", "lost-0", PROMPTS[1], [results[0].first_token], results[0].kv)
    assert [(i.finish_reason, i.error_code) for i in failed] == [("error", "kv_transfer")]
    assert "unreachable" in failed[0].error
    items = await gw.decode("d1", "lost-1", PROMPTS[1], [results[1].first_token], results[1].kv)
    assert [results[1].first_token] + tokens(items) == expected[1]
    await stack.idle("d0", "d1")
    for rid in ("lost-0", "lost-1"):  # (what its lease expiry would have done)
        p0.leases.release(rid)
    await stack.idle("p0")


async def test_late_duplicates_do_not_disturb_the_original(stack, expected) -> None:
    """A request delivered twice while the first is in its pull is refused as a duplicate
    without touching the original's lease; a late ReleaseLease for a lease gone is a no-op."""
    gw = stack.gw
    result = await gw.prefill("dup", PROMPTS[0])
    client = stack.kv["d0"]
    client.gate = asyncio.Event()
    await gw.send_decode("d0", "dup", PROMPTS[0], [result.first_token], result.kv)
    await asyncio.wait_for(client.started.wait(), 5)
    await gw.send_decode("d0", "dup", PROMPTS[0], [result.first_token], result.kv)
    refused = await asyncio.wait_for(gw.queue("dup").get(), 5)
    assert refused.error_code == "invalid" and "duplicate" in refused.error
    assert stack.workers["p0"].leases.get("dup") is not None  # the original still pulls it
    client.gate.set()
    items = await gw.items("dup")
    assert [result.first_token] + tokens(items) == expected[0]
    await gw.bus.publish(gw.bus.subjects.lease("p0"), ReleaseLease("dup"))  # late, again
    again = await gw.prefill("dup-2", PROMPTS[1])
    assert again.kv is not None
    await gw.bus.publish(gw.bus.subjects.lease("p0"), ReleaseLease("dup-2"))
    await stack.idle("p0", "d0")


async def test_deadlines(stack, engines, monkeypatch) -> None:
    gw = stack.gw
    late = await gw.prefill("late-p", PROMPTS[1], deadline=time.time() - 1)
    assert late.error_code == "deadline" and late.kv is None
    items = await gw.decode("d0", "late-d", PROMPTS[1], [], None, deadline=time.time() - 1)
    assert [i.error_code for i in items] == ["deadline"]
    # A deadline that passes mid-generation does not cut a streaming answer off: it bounds
    # the wait for the first token only (the gateway judges stalls after that, and cancels).
    # Steps are slowed to >= 10 ms so that the 60 tokens outlast the deadline for sure.
    step = engines["d0"].step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engines["d0"], "step", slow_step)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    t0 = time.time()
    items = await gw.decode("d0", "slow", PROMPTS[1], [], None, sp=long, deadline=t0 + 0.3)
    assert time.time() > t0 + 0.3 + 0.25  # past the deadline and a deadline check after it
    assert items[-1].finish_reason == "length" and len(tokens(items)) == 60
    assert not any(i.error_code for i in items)
    monkeypatch.undo()
    # a deadline that passes while the pull is in flight: error now, and the pull of KV nobody
    # wants is stopped, its blocks and the lease freed without waiting for the transfer
    result = await gw.prefill("slow-pull", PROMPTS[0])
    client = stack.kv["d0"]
    client.gate = asyncio.Event()
    await gw.send_decode(
        "d0", "slow-pull", PROMPTS[0], [result.first_token], result.kv, deadline=time.time() + 0.3
    )
    (item,) = await gw.items("slow-pull")
    assert item.error_code == "deadline"
    await stack.idle("p0", "d0")  # the gate is still shut: the pull was cancelled, not waited
    client.gate.set()


async def test_refused_pull_fails_or_recomputes_by_policy(stack, expected) -> None:
    gw = stack.gw
    for wid in ("d0", "d1"):
        rid = f"refused-{wid}"
        result = await gw.prefill(rid, PROMPTS[1])
        await gw.bus.publish(gw.bus.subjects.lease("p0"), ReleaseLease(rid))  # lease gone
        await stack.idle("p0")
        items = await gw.decode(wid, rid, PROMPTS[1], [result.first_token], result.kv)
        if wid == "d0":
            assert [i.error_code for i in items] == ["kv_transfer"]
            assert "no lease" in items[0].error and not tokens(items)
        else:
            assert [result.first_token] + tokens(items) == expected[1]
    await stack.idle("d0", "d1")


async def test_cancellation(stack) -> None:
    gw = stack.gw
    # mid-pull: nothing more is said; blocks and lease come back once the pull is over
    result = await gw.prefill("c-pull", PROMPTS[0])
    client = stack.kv["d0"]
    client.gate = asyncio.Event()
    await gw.send_decode("d0", "c-pull", PROMPTS[0], [result.first_token], result.kv)
    await asyncio.wait_for(client.started.wait(), 5)
    await gw.cancel("c-pull")
    await asyncio.sleep(0.05)
    client.gate.set()
    await stack.idle("p0", "d0")
    assert gw.queue("c-pull").empty()
    # mid-stream
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    await gw.send_decode("d0", "c-stream", PROMPTS[1], [], None, sp=long)
    first = await asyncio.wait_for(gw.queue("c-stream").get(), 5)
    assert first.token_ids and first.error is None
    await gw.cancel("c-stream")
    await stack.idle("d0")
    # while its KV waits under a lease, and before the request arrives (overtaken)
    await gw.prefill("c-leased", PROMPTS[0])
    await gw.cancel("c-leased")
    await gw.cancel("c-early")
    await asyncio.sleep(0.05)
    await gw.send_decode("d0", "c-early", PROMPTS[1], [], None)
    await gw.decode("d0", "after", PROMPTS[1], [], None)  # handled after "c-early"
    assert gw.queue("c-early").empty()
    await stack.idle("p0", "d0")


async def test_items_carry_positions_and_a_stream_check_is_answered_in_line(
    stack, expected
) -> None:
    """Each item says where its first token sits in its choice's output (the tokens the request
    came with included; a forked choice starts empty). A StreamCheck makes the worker send
    that inbox again what it sent it lately (the gateway drops what it has), then answer
    behind every item before it: the positions then, or "unknown" once the request is over."""
    gw = stack.gw
    check = StreamCheck("pos", gw.inbox)
    result = await gw.prefill("pos", PROMPTS[0])
    await gw.send_decode("d0", "pos", PROMPTS[0], [result.first_token], result.kv)
    await gw.bus.publish(gw.bus.subjects.decode("d0"), check)
    got, answered = [result.first_token], False
    while len(got) < MAX_TOKENS or not answered:
        item = await asyncio.wait_for(gw.queue("pos").get(), 10)
        if item.token_ids and item.position < len(got):  # sent again: what we have
            assert got[item.position : item.position + len(item.token_ids)] == item.token_ids
        elif item.token_ids:
            assert item.position == len(got)
            got += item.token_ids
        else:  # the answer: where the stream stood, or gone once it had ended
            answered = True
            done = item.error_code == "unknown" and len(got) == MAX_TOKENS
            assert done or (item.position == len(got) and item.error is None)
    assert got == expected[0]
    await gw.bus.publish(gw.bus.subjects.decode("d0"), check)
    replayed = []
    while (item := await asyncio.wait_for(gw.queue("pos").get(), 10)).error is None:
        replayed += item.token_ids  # what came after the first check's replay
    assert item.error_code == "unknown" and item.finish_reason == "error"
    assert replayed == got[len(got) - len(replayed) :]
    two = SamplingParams(temperature=1.0, seed=5, max_tokens=4, n=2)
    await gw.send_decode("d0", "pos-2", PROMPTS[1], [], None, sp=two)
    counts, finished = {0: 0, 1: 0}, 0
    while finished < 2:
        item = await asyncio.wait_for(gw.queue("pos-2").get(), 10)
        assert item.position == counts[item.index]
        counts[item.index] += len(item.token_ids)
        finished += item.finish_reason is not None
    assert counts == {0: 4, 1: 4}
    await stack.idle("p0", "d0")
