"""The workers' probe handlers on real engines, with the UCX pull replaced by a copy: a probe
takes one free block, never one a request needs, and always gives it back."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdserve.services import probe
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.engine_thread import EngineThread
from pdserve.services.prefill.worker import PrefillWorker
from pdserve.services.probe import block_matches
from pdserve.shared.bus.protocol import decode as decode_message
from pdserve.shared.bus.protocol import encode
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.probe import MAX_PROBE_LEASES, ProbeLeaseRequest, ProbePullRequest
from pdserve.shared.kv.transfer import KVTransferError, LeaseTable, TransferStats
from pdserve.shared.sampling import SamplingParams

BLOCKS = MAX_PROBE_LEASES + 1


@pytest.fixture(scope="module")
def engine_pair() -> tuple[LLMEngine, LLMEngine]:
    cfg = EngineConfig(model="demo", num_kv_blocks=BLOCKS, block_size=4)
    return LLMEngine(cfg, prefill_only=True), LLMEngine(cfg)


@pytest.fixture
async def engines(engine_pair):
    """Both engines stepped by their own threads, as in a worker (step results are dropped)."""
    loop = asyncio.get_running_loop()
    threads = [EngineThread(e, loop, lambda result: None) for e in engine_pair]
    for t in threads:
        t.start()
    yield engine_pair
    for t in threads:
        t.stop()
        assert t.error is None


async def until(predicate, timeout: float = 10.0) -> None:
    """Commands apply on the engine thread: wait until ``predicate`` sees their effect."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def free(engine: LLMEngine) -> int:
    return engine.stats().free_blocks


async def lease_probe(p: SimpleNamespace, req: ProbeLeaseRequest):
    """What the prefill worker's probe handler passes."""
    return await probe.lease_probe(req, p.engine, p.leases, p.make_handle, p.worker_id, p.draining)


async def pull_probe(d: SimpleNamespace, req: ProbePullRequest):
    """What the decode worker's probe handler passes."""
    return await probe.pull_probe(req, d.engine, d.kv_client, d.worker_id, d.draining)


def prefill_worker(engine: LLMEngine) -> SimpleNamespace:
    worker = SimpleNamespace(
        worker_id="p0",
        draining=False,
        engine=engine,
        leases=LeaseTable(on_free=engine.release),
        kv_server=SimpleNamespace(address="ucx1:00:AA=="),
        rank_addresses=[],  # TP 1
    )
    worker.make_handle = lambda lease: PrefillWorker.make_handle(worker, lease)
    return worker


class CopyClient:
    """Stands in for KVClient: 'pulls' by copying from the prefill engine's cache."""

    def __init__(self, source: LLMEngine, fail: bool = False) -> None:
        self.source, self.fail, self.pulls = source, fail, 0

    def __call__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def pull(self, bus_id, handle, dst, timeout, heads=None) -> TransferStats:
        if self.fail:
            raise KVTransferError("unreachable")
        self.pulls += 1
        self.engine.kv_cache[dst[0]].copy_(self.source.kv_cache[handle.block_ids[0]])
        block = self.engine.kv_cache[dst[0]]
        return TransferStats(block.numel() * block.element_size(), 1, 1, 0.001)


def decode_worker(engine: LLMEngine, client: CopyClient) -> SimpleNamespace:
    client(engine)
    return SimpleNamespace(
        worker_id="d0",
        draining=False,
        engine=engine,
        kv_client=client,
    )


async def test_probe_round_trip_returns_every_block(engines) -> None:
    prefill, decode = engines
    p = prefill_worker(prefill)
    lease = await lease_probe(p, ProbeLeaseRequest("doctor-a", ttl=5))
    assert lease.status == "ok" and lease.kv is not None and lease.kv.num_tokens == 1
    await until(lambda: free(prefill) == BLOCKS - 1)
    assert block_matches(prefill.kv_cache[lease.kv.block_ids[0]], "doctor-a")
    client = CopyClient(prefill)
    reply = await pull_probe(decode_worker(decode, client), ProbePullRequest("doctor-a", lease.kv))
    assert reply.status == "ok" and reply.verified and reply.error is None
    assert client.pulls == 3 and len(reply.pull_seconds) == 3 and reply.num_bytes > 0
    await until(lambda: free(decode) == BLOCKS)
    p.leases.release("doctor-a")  # what the doctor's ReleaseLease does
    await until(lambda: free(prefill) == BLOCKS)


async def test_a_stale_block_or_a_failed_pull_fails_and_frees_the_block(engines) -> None:
    prefill, decode = engines
    p = prefill_worker(prefill)
    lease = await lease_probe(p, ProbeLeaseRequest("doctor-b", ttl=5))
    # the pattern depends on the probe id: another probe's bytes do not verify
    wrong = ProbePullRequest("doctor-c", lease.kv, pulls=1)
    reply = await pull_probe(decode_worker(decode, CopyClient(prefill)), wrong)
    assert reply.status == "failed" and not reply.verified
    reply = await pull_probe(
        decode_worker(decode, CopyClient(prefill, fail=True)),
        ProbePullRequest("doctor-b", lease.kv),
    )
    assert reply.status == "failed" and "unreachable" in reply.error
    await until(lambda: free(decode) == BLOCKS)
    p.leases.release("doctor-b")
    await until(lambda: free(prefill) == BLOCKS)


async def test_probes_are_refused_when_a_block_may_be_missed(engines) -> None:
    prefill, decode = engines
    p = prefill_worker(prefill)
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    # a parked prefill holds every block, and a request waits behind it
    prefill.add_request("held", list(range(1, BLOCKS * 4 - 2)), one)
    await until(lambda: free(prefill) == 0)
    reply = await lease_probe(p, ProbeLeaseRequest("doctor-e"))
    assert reply.status == "refused" and "no free KV block" in reply.error
    prefill.add_request("waiting-1", [1, 2, 3], one)
    await until(lambda: prefill.stats().waiting == 1)
    reply = await lease_probe(p, ProbeLeaseRequest("doctor-d"))
    assert reply.status == "refused" and "waiting" in reply.error
    prefill.abort("waiting-1")
    prefill.release("held")
    await until(lambda: free(prefill) == BLOCKS and not prefill.stats().waiting)
    for i in range(MAX_PROBE_LEASES):
        assert (await lease_probe(p, ProbeLeaseRequest(f"doctor-h{i}"))).status == "ok"
    reply = await lease_probe(p, ProbeLeaseRequest("doctor-i"))
    assert reply.status == "refused" and "probe leases held" in reply.error
    for i in range(MAX_PROBE_LEASES):
        p.leases.release(f"doctor-h{i}")
    assert "start with" in (await lease_probe(p, ProbeLeaseRequest("req-1"))).error
    p.draining = True
    assert "draining" in (await lease_probe(p, ProbeLeaseRequest("doctor-f"))).error
    # decode: one request's blocks are reserved for its pull, another waits for blocks
    d = decode_worker(decode, CopyClient(prefill))
    decode.add_request("pulling", list(range(1, BLOCKS * 4 - 2)), one, [7], remote_kv=True)
    decode.add_request("queued", [1, 2, 3], one, [7], remote_kv=True)
    await until(lambda: decode.stats().pulling == 1 and decode.stats().waiting == 1)
    handle = p.make_handle(p.leases.add("x", [0], 1, 5))
    reply = await pull_probe(d, ProbePullRequest("doctor-g", handle))
    assert reply.status == "refused" and "waiting" in reply.error
    decode.abort("queued")
    await until(lambda: not decode.stats().waiting)
    reply = await pull_probe(d, ProbePullRequest("doctor-g", handle))
    assert reply.status == "refused" and "no free KV block" in reply.error
    decode.kv_failed("pulling", "never pulled")  # the fail policy: finished with an error
    p.leases.release("x")
    await until(lambda: free(prefill) == BLOCKS and free(decode) == BLOCKS)


async def test_replies_name_the_tp_ranks_even_when_refused(engines) -> None:
    prefill, decode = engines
    ranks = [  # Worker.tp_ranks of a TP-2 worker
        {"rank": 0, "pid": 11, "transports": ["tcp/lo"]},
        {"rank": 1, "pid": 12, "transports": []},
    ]
    p = prefill_worker(prefill)
    reply = await probe.lease_probe(
        ProbeLeaseRequest("doctor-t"), prefill, p.leases, p.make_handle, "p0", True, ranks
    )
    assert reply.status == "refused" and reply.rank_pids == [11, 12]
    assert decode_message(encode(reply)).rank_transports == [["tcp/lo"], []]
    handle = p.make_handle(p.leases.add("y", [0], 1, 5))
    d = decode_worker(decode, CopyClient(prefill))
    reply = await probe.pull_probe(
        ProbePullRequest("doctor-t", handle), decode, d.kv_client, "d0", True, ranks
    )
    assert reply.status == "refused" and reply.rank_pids == [11, 12]
    assert (await lease_probe(p, ProbeLeaseRequest("doctor-u"))).rank_pids == []  # TP 1
    p.leases.release("y")
    p.leases.release("doctor-u")
    await until(lambda: free(prefill) == BLOCKS and free(decode) == BLOCKS)
