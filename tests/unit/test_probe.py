"""The workers' probe handlers on real engines, with the UCX pull replaced by a copy: a probe
takes one free block, never one a request needs, and always gives it back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.engine.engine import LLMEngine
from services.prefill.worker import PrefillWorker
from services.probe import block_matches, lease_probe, pull_probe
from shared.config import EngineConfig
from shared.kv_probe import MAX_PROBE_LEASES, ProbeLeaseRequest, ProbePullRequest
from shared.kv_transfer import KVTransferError, LeaseTable, TransferStats
from shared.sampling import SamplingParams

BLOCKS = MAX_PROBE_LEASES + 1


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    cfg = EngineConfig(model="demo", num_kv_blocks=BLOCKS, block_size=4)
    return LLMEngine(cfg, prefill_only=True), LLMEngine(cfg)


def prefill_worker(engine: LLMEngine) -> SimpleNamespace:
    worker = SimpleNamespace(
        worker_id="p0",
        draining=False,
        engine=engine,
        leases=LeaseTable(on_free=engine.release),
        kv_server=SimpleNamespace(address="ucx1:00:AA=="),
    )
    worker.make_handle = lambda lease: PrefillWorker.make_handle(worker, lease)
    return worker


class CopyClient:
    """Stands in for KVClient: 'pulls' by copying from the prefill engine's cache."""

    def __init__(self, source: LLMEngine, fail: bool = False) -> None:
        self.source, self.fail, self.pulls = source, fail, 0

    def __call__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def pull(self, request_id, handle, dst, timeout) -> TransferStats:
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
        admission=[],
        kv_client=client,
        wake_engine=lambda: None,
    )


async def test_probe_round_trip_returns_every_block(engines) -> None:
    prefill, decode = engines
    p = prefill_worker(prefill)
    lease = await lease_probe(p, ProbeLeaseRequest("doctor-a", ttl=5))
    assert lease.status == "ok" and lease.kv is not None and lease.kv.num_tokens == 1
    assert prefill.block_manager.num_free_blocks == BLOCKS - 1
    assert block_matches(prefill.kv_cache[lease.kv.block_ids[0]], "doctor-a")
    client = CopyClient(prefill)
    reply = await pull_probe(decode_worker(decode, client), ProbePullRequest("doctor-a", lease.kv))
    assert reply.status == "ok" and reply.verified and reply.error is None
    assert client.pulls == 3 and len(reply.pull_seconds) == 3 and reply.num_bytes > 0
    assert decode.block_manager.num_free_blocks == BLOCKS and not decode.seqs
    p.leases.release("doctor-a")  # what the doctor's ReleaseLease does
    assert prefill.block_manager.num_free_blocks == BLOCKS and not prefill.seqs


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
    assert decode.block_manager.num_free_blocks == BLOCKS and not decode.seqs
    p.leases.release("doctor-b")
    assert prefill.block_manager.num_free_blocks == BLOCKS


async def test_probes_are_refused_when_a_block_may_be_missed(engines) -> None:
    prefill, decode = engines
    p = prefill_worker(prefill)
    prefill.add_request("waiting-1", [1, 2, 3], SamplingParams(max_tokens=1))
    reply = await lease_probe(p, ProbeLeaseRequest("doctor-d"))
    assert reply.status == "refused" and "waiting" in reply.error
    prefill.abort("waiting-1")
    held = prefill.reserve("held", list(range(BLOCKS * 4 - 1)), [], SamplingParams(max_tokens=1))
    assert held is not None and prefill.block_manager.num_free_blocks == 0
    reply = await lease_probe(p, ProbeLeaseRequest("doctor-e"))
    assert reply.status == "refused" and "no free KV block" in reply.error
    prefill.release("held")
    for i in range(MAX_PROBE_LEASES):
        assert (await lease_probe(p, ProbeLeaseRequest(f"doctor-h{i}"))).status == "ok"
    reply = await lease_probe(p, ProbeLeaseRequest("doctor-i"))
    assert reply.status == "refused" and "probe leases held" in reply.error
    for i in range(MAX_PROBE_LEASES):
        p.leases.release(f"doctor-h{i}")
    assert "start with" in (await lease_probe(p, ProbeLeaseRequest("req-1"))).error
    p.draining = True
    assert "draining" in (await lease_probe(p, ProbeLeaseRequest("doctor-f"))).error
    d = decode_worker(decode, CopyClient(prefill))
    d.admission.append(object())  # a request waits for blocks: the probe must not take one
    reply = await pull_probe(
        d, ProbePullRequest("doctor-g", p.make_handle(p.leases.add("x", [0], 1, 5)))
    )
    assert reply.status == "refused" and "waiting" in reply.error
    assert prefill.block_manager.num_free_blocks == BLOCKS
    assert decode.block_manager.num_free_blocks == BLOCKS
