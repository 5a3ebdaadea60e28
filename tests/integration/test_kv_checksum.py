"""``--kv-checksum`` over real UCX: pulls whose bytes were damaged in flight are caught and never
served, first between a KV server and client in one process, then between real workers, where
the decode worker's recompute policy still answers exactly what HF does.

Each damaging case is also run with the check off, to show the damage is real: the same bytes
would otherwise land in the cache (and change the answer), so these tests fail when
verification is disabled."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from pdserve.services.control.processes import free_port
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.tp_layout import TP_KEY, kv_head_range
from pdserve.shared.kv.transfer import KVChecksumError, KVClient, KVServer, LeaseTable
from pdserve.shared.telemetry import tracing
from tests.integration.corrupting_prefill import _damage
from tests.integration.stack import log_text, start_nats, start_service
from tests.integration.test_kv_transfer import BLOCK, DIM, HEADS, LAYERS, Pair, cache, fingerprint
from tests.integration.test_up import scrape
from tests.integration.worker_client import GREEDY, connected, tokens
from tests.oracle import hf_greedy
from tests.otlp_receiver import OtlpReceiver

SRC, DST = [3, 4, 9, 10], [7, 8, 1, 2]


class CheckedPair(Pair):
    def __init__(self, server_hashes: bool, client_checks: bool) -> None:
        super().__init__()
        self.server = KVServer(self.src, fingerprint(), self.leases, checksum=server_hashes)
        self.client = KVClient(self.dst, fingerprint(), BLOCK, checksum=client_checks)


@pytest.mark.parametrize("server_hashes", [True, False])
async def test_a_clean_pull_verifies(server_hashes: bool) -> None:
    """Hashed at lease time, or (server without --kv-checksum) when sent: either way it checks."""
    async with CheckedPair(server_hashes, client_checks=True) as p:
        stats = await p.client.pull("r1", p.lease("r1", SRC, 4 * BLOCK), DST)
        assert torch.equal(p.dst[DST], p.src[SRC]) and stats.checksum_seconds > 0


@pytest.mark.parametrize("client_checks", [True, False])
async def test_bytes_damaged_in_flight_fail_the_pull(client_checks: bool) -> None:
    async with CheckedPair(server_hashes=True, client_checks=client_checks) as p:
        p.server.fault = _damage
        handle = p.lease("r1", SRC, 4 * BLOCK)
        if not client_checks:  # unchecked, the damage lands in the cache unseen
            await p.client.pull("r1", handle, DST)
            assert not torch.equal(p.dst[DST], p.src[SRC])
            return
        with pytest.raises(KVChecksumError, match="failed its checksum.*first at block 7"):
            await p.client.pull("r1", handle, DST)
        p.server.fault = None  # the lease stays usable: a retry of the same blocks verifies
        await p.client.pull("r1", handle, DST)
        assert torch.equal(p.dst[DST], p.src[SRC])


async def test_a_block_changed_under_its_lease_fails_the_pull() -> None:
    """Hashes are taken when the lease is added, so a block reused too early is caught too."""
    async with CheckedPair(server_hashes=True, client_checks=True) as p:
        handle = p.lease("r1", SRC, 4 * BLOCK)
        await asyncio.sleep(0.2)  # the lease's hashes are taken in a thread
        p.src[9, 1, 0, 2, 1] += 1.0
        with pytest.raises(KVChecksumError, match="first at block 1 head 1"):
            await p.client.pull("r1", handle, DST)


async def test_head_sliced_pulls_verify_each_decode_rank() -> None:
    """A TP-1 prefill cache pulled by the two ranks of a TP-2 decode worker: each rank checks
    exactly the heads it pulled against the hashes taken of the whole cache."""
    fp = {**fingerprint(), TP_KEY: 1}
    src, leases = cache(), LeaseTable(lambda _: None)
    server = KVServer(src, fp, leases, checksum=True)
    await server.start()
    try:
        lease = leases.add("r1", SRC, 4 * BLOCK, 30.0)
        handle = KVHandle("p", server.address, SRC, 4 * BLOCK, fp, lease.expires, lease.token)
        for rank in range(2):
            heads = kv_head_range(HEADS, 2, rank)
            dst = torch.full((src.shape[0], LAYERS, 2, BLOCK, heads[1] - heads[0], DIM), -1.0)
            client = KVClient(dst, {**fp, TP_KEY: 2}, BLOCK, heads=heads, checksum=True)
            await client.pull("r1", handle, DST, heads=heads)
            assert torch.equal(dst[DST], src[SRC][:, :, :, :, heads[0] : heads[1]])
            server.fault = _damage
            with pytest.raises(KVChecksumError):
                await client.pull("r1", handle, DST, heads=heads)
            server.fault = None
            await client.close()
    finally:
        await server.stop()


# --- real workers ------------------------------------------------------------------------------

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks
OPTIONS = {
    "dtype": "float64",  # greedy ties cannot flip between engine and oracle
    "num_kv_blocks": 64,
    "block_size": 16,
    "heartbeat_seconds": 0.2,
}


async def test_damaged_kv_is_recomputed_not_served(tmp_path, llama_dir) -> None:
    """A prefill worker that damages every pull; decode d-check verifies (--kv-checksum) and
    recomputes; d-blind does not verify. d-check answers HF's tokens, counts the failure and
    marks its kv.transfer span; d-blind's answer, from the damaged KV, differs."""
    expected = hf_greedy(llama_dir, [PROMPT], GREEDY.max_tokens)[0]
    nats = start_nats(tmp_path)
    traces = OtlpReceiver()
    traces.start_in_thread()
    opts, env = {**OPTIONS, "model": str(llama_dir)}, traces.env()
    metrics_port = free_port()
    corrupting = [sys.executable, "-m", "tests.integration.corrupting_prefill"]
    children = [
        start_service(
            "prefill", nats.url, tmp_path, env, {**opts, "worker_id": "p-bad"}, argv=corrupting
        ),
        start_service(
            "decode",
            nats.url,
            tmp_path,
            env,
            {
                **opts,
                "worker_id": "d-check",
                "kv_checksum": True,
                "kv_failure_policy": "recompute",
                "metrics_port": metrics_port,
            },
        ),
        start_service("decode", nats.url, tmp_path, env, {**opts, "worker_id": "d-blind"}),
    ]
    try:
        async with connected(nats.url, children) as gw:
            for worker in ("d-check", "d-blind"):
                result = await gw.prefill("p-bad", worker, PROMPT)
                assert result.first_token == expected[0]
                items = await gw.decode(worker, worker, PROMPT, [result.first_token], result.kv)
                assert items[-1].error is None, items[-1].error
                got = [result.first_token] + tokens(items)
                if worker == "d-check":
                    assert got == expected
                else:
                    assert got != expected, "the damage changed nothing: the test proves nothing"
            log = log_text(children[1], 100000)
            assert "is corrupt, not served (recompute)" in log, log
            counted = [
                line
                for line in scrape(f"http://127.0.0.1:{metrics_port}").splitlines()
                if line.startswith("pdserve_kv_checksum_failures_total")
            ]
            assert len(counted) == 1 and counted[0].endswith(" 1.0"), counted

            def marked(spans) -> bool:
                return any(
                    s.name == tracing.SPAN_KV_TRANSFER
                    and s.attributes.get("pdserve.request_id") == "d-check"
                    and s.attributes.get(tracing.ATTR_KV_CHECKSUM) == "mismatch"
                    for s in spans
                )

            await traces.wait_for(marked, 20)
    finally:
        for child in children:
            child.stop()
        nats.stop()
        traces.stop_in_thread()
