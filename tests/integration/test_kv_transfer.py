"""KV pulls over real ucxx on loopback, between two block-major caches."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.transfer import (
    FingerprintMismatch,
    KVClient,
    KVServer,
    KVTransferError,
    LeaseTable,
    block_runs,
    format_address,
)
from pdserve.shared.kv.ucx_config import interface_addresses
from tests.integration.kv_peer import BLOCK, DIM, HEADS, LAYERS, NUM_BLOCKS, peer_cache
from tests.integration.kv_peer import fingerprint as peer_fingerprint
from tests.integration.stack import listening_sockets


def fingerprint(dtype: torch.dtype = torch.float32) -> dict:
    return {**peer_fingerprint(), "dtype": str(dtype).removeprefix("torch.")}


def cache(dtype: torch.dtype = torch.float32, fill: float | None = None) -> torch.Tensor:
    shape = (NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS, DIM)
    if fill is None:
        return torch.randn(shape).to(dtype)
    return torch.full(shape, fill, dtype=dtype)


class Pair:
    """A prefill-side server and a decode-side client in one event loop."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.src = cache(dtype)
        self.dst = cache(dtype, fill=-1.0)
        self.freed: list[str] = []
        self.leases = LeaseTable(self.freed.append)
        self.server = KVServer(self.src, fingerprint(dtype), self.leases)
        self.client = KVClient(self.dst, fingerprint(dtype), BLOCK)

    async def __aenter__(self) -> Pair:
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.server.stop()

    def lease(self, rid: str, blocks: list[int], num_tokens: int, ttl: float = 30.0) -> KVHandle:
        lease = self.leases.add(rid, blocks, num_tokens, ttl)
        return KVHandle(
            "prefill-0",
            self.server.address,
            blocks,
            num_tokens,
            fingerprint(self.src.dtype),
            lease.expires,
            lease.token,
        )


def test_block_runs_coalesce_only_where_both_sides_are_consecutive() -> None:
    assert block_runs([3, 4, 5, 9, 10], [7, 8, 9, 1, 2]) == [(3, 7, 3), (9, 1, 2)]
    assert block_runs([3, 4, 5], [7, 9, 10]) == [(3, 7, 1), (4, 9, 2)]
    assert block_runs([], []) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_pull_copies_exactly_the_leased_blocks(dtype) -> None:
    async with Pair(dtype) as p:
        src_blocks = [3, 4, 5, 9, 10, 11, 20]
        dst_blocks = [12, 13, 14, 1, 2, 30, 31]
        num_tokens = 6 * BLOCK + 1  # last block partly filled: all 7 blocks travel
        handle = p.lease("r1", src_blocks, num_tokens)
        stats = await p.client.pull("r1", handle, dst_blocks)
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(p.dst[d], p.src[s]), (s, d)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_blocks))
        assert (p.dst[untouched] == -1).all()
        assert stats.num_blocks == 7
        assert stats.num_messages == len(block_runs(src_blocks, dst_blocks)) == 4
        assert stats.num_bytes == 7 * p.src[0].numel() * p.src.element_size()
        assert p.server.pulls_served == 1
        # the lease is the worker's business: a pull alone frees nothing
        assert p.freed == [] and len(p.leases) == 1


async def test_only_blocks_covering_num_tokens_move() -> None:
    async with Pair() as p:
        handle = p.lease("r1", [0, 1, 2], num_tokens=BLOCK + 1)  # needs 2 of 3 blocks
        stats = await p.client.pull("r1", handle, [5, 6, 7])
        assert stats.num_blocks == 2
        assert torch.equal(p.dst[5:7], p.src[0:2]) and (p.dst[7] == -1).all()


async def test_concurrent_pulls_share_one_endpoint() -> None:
    async with Pair() as p:
        handles = [p.lease(f"r{i}", [2 * i, 2 * i + 1], 2 * BLOCK) for i in range(6)]
        await asyncio.gather(
            *(p.client.pull(f"r{i}", h, [31 - 2 * i, 30 - 2 * i]) for i, h in enumerate(handles))
        )
        for i in range(6):
            assert torch.equal(p.dst[31 - 2 * i], p.src[2 * i])
            assert torch.equal(p.dst[30 - 2 * i], p.src[2 * i + 1])
        assert len(p.client.endpoints) == 1  # pulls tell their messages apart by tag


async def test_fingerprint_mismatch_fails_before_connecting() -> None:
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    other = {**fingerprint(), "num_kv_heads": 4}
    nobody = format_address(1 << 63, b"not a UCX address")
    handle = KVHandle("p", nobody, [0], 1, other, time.time() + 30, "t")
    with pytest.raises(FingerprintMismatch, match="num_kv_heads"):
        await client.pull("r1", handle, [0])
    assert len(client.endpoints) == 0
    assert (dst == -1).all()


async def test_server_ignores_pullers_without_the_lease_token() -> None:
    """No reply, no connection back, no byte: the request's reply address is not even used."""
    async with Pair() as p:
        good = p.lease("r1", [0, 1], 2 * BLOCK)
        wrong_token = KVHandle(**{**good.__dict__, "token": "guess"})
        with pytest.raises(KVTransferError, match="timed out"):
            await p.client.pull("r1", wrong_token, [5, 6], timeout=0.5)
        with pytest.raises(KVTransferError, match="timed out"):  # a lease that never existed
            await p.client.pull("r9", good, [5, 6], timeout=0.5)
        assert p.server.requests_dropped == 2 and len(p.server.endpoints) == 0
        assert (p.dst == -1).all()
        await p.client.pull("r1", good, [5, 6])
        assert torch.equal(p.dst[5:7], p.src[0:2])


async def test_server_checks_layout_and_blocks_before_sending() -> None:
    async with Pair() as p:
        good = p.lease("r1", [0, 1], 2 * BLOCK)
        # a puller that claims a layout the server does not have
        liar = KVClient(p.dst, {**fingerprint(), "head_dim": 4}, BLOCK)
        bad_fp = KVHandle(**{**good.__dict__, "fingerprint": {**fingerprint(), "head_dim": 4}})
        with pytest.raises(KVTransferError, match="layout mismatch"):
            await liar.pull("r1", bad_fp, [5, 6])
        await liar.close()
        beyond = KVHandle(**{**good.__dict__, "block_ids": [0, 2]})  # block 2 is not leased
        with pytest.raises(KVTransferError, match="not part of the lease"):
            await p.client.pull("r1", beyond, [5, 6])
        assert (p.dst == -1).all()  # nothing moved
        assert p.server.pulls_refused == 2
        await p.client.pull("r1", good, [5, 6])
        assert torch.equal(p.dst[5:7], p.src[0:2])


async def test_released_lease_cannot_be_pulled() -> None:
    async with Pair() as p:
        handle = p.lease("r1", [0], 1)
        assert p.leases.release("r1")
        assert p.freed == ["r1"]
        with pytest.raises(KVTransferError, match="no lease"):
            await p.client.pull("r1", handle, [3])


@contextmanager
def peer(blocks: list[int], host: str = "127.0.0.1") -> Iterator[tuple[subprocess.Popen, KVHandle]]:
    """A KV server process holding lease r1 over ``blocks`` of ``peer_cache()``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.kv_peer", "--host", host, *map(str, blocks)],
        stdout=subprocess.PIPE,
        text=True,
        # not the UCX variables this process set for itself (they would win over --host)
        env={
            **{
                k: v
                for k, v in os.environ.items()
                if k not in ("UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE")
            },
            "OMP_NUM_THREADS": "1",
            "UCX_WARN_UNUSED_ENV_VARS": "n",
        },
    )
    try:
        info = json.loads(proc.stdout.readline())
        handle = KVHandle(
            "prefill-x",
            info["address"],
            blocks,
            len(blocks) * BLOCK,
            fingerprint(),
            info["expires"],
            info["token"],
        )
        yield proc, handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


async def test_pull_from_another_process() -> None:
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    with peer([4, 5, 6]) as (_, handle):
        await client.pull("r1", handle, [10, 11, 12])
    assert torch.equal(dst[10:13], peer_cache()[4:7])
    await client.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "external", "0.0.0.0"])
async def test_kv_server_listens_only_on_its_host(host: str) -> None:
    """No wildcard sockets: UCX's TCP transport listens on --ucx-host's interface alone."""
    # UCX's TCP transport skips link-local interfaces (a docker0 on 169.254.x.y, say)
    usable = [
        a for a in interface_addresses().values() if not ipaddress.ip_address(a).is_link_local
    ]
    external = [a for a in usable if not a.startswith("127.")]
    if host == "external":
        if not external:
            pytest.skip("this machine has no non-loopback interface")
        host = external[0]
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    with peer([2], host) as (proc, handle):
        if host.startswith("127."):  # UCX pairs loopback only with loopback: we are on lo
            await client.pull("r1", handle, [9])
            assert torch.equal(dst[9], peer_cache()[2])
        addresses = {a for a, _ in listening_sockets(proc.pid)}
    await client.close()
    if host == "0.0.0.0":  # every interface, each on its own address
        assert addresses == set(usable)
    else:
        assert addresses == {host}


async def test_killed_server_fails_the_pull_fast() -> None:
    client = KVClient(cache(fill=-1.0), fingerprint(), BLOCK)
    with peer([1]) as (proc, handle):
        proc.send_signal(signal.SIGSTOP)  # it gets the request but never answers...
        pull = asyncio.ensure_future(client.pull("r1", handle, [3], timeout=60.0))
        await asyncio.sleep(0.5)
        proc.kill()  # ...and dies: the endpoint's error handling ends the pull
        # reaped, as pdserve up's supervisor does: over shared memory no socket breaks, and
        # UCX's keepalive sees the peer gone only once its pid is (a zombie still has it)
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            await pull
        assert time.monotonic() - t0 < 10
    await client.close()


async def test_a_late_server_cannot_write_into_blocks_of_a_timed_out_pull() -> None:
    """The timed-out puller reuses its blocks at once; a server that wakes up later and sends
    must not reach them (the endpoint's abort cancelled every posted receive)."""
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    with peer([0, 1, 2, 3]) as (proc, handle):
        await client.pull("r1", handle, [20, 21, 22, 23])  # endpoints exist and work
        dst[20:24] = -1.0
        proc.send_signal(signal.SIGSTOP)
        with pytest.raises(KVTransferError, match="timed out"):
            await client.pull("r1", handle, [20, 21, 22, 23], timeout=1.0)
        proc.send_signal(signal.SIGCONT)  # it now answers the stale request
        await asyncio.sleep(2.0)
        assert (dst == -1).all()
        await client.pull("r1", handle, [8, 9, 10, 11])  # and still serves fresh pulls
        assert torch.equal(dst[8:12], peer_cache()[0:4])
    await client.close()


async def test_a_pull_survives_another_pulls_cancel_on_their_shared_endpoint() -> None:
    """A decode worker cancels a pull nobody wants (its client hung up) by aborting the endpoint
    it shares with every other pull from that peer, which cancels their receives too. Those
    pulls reconnect and complete: a bystander's KV is not lost to another request's cancel (a
    streamed pull failed in CI that way, and fell back to recomputing its prompt)."""
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    with peer([0, 1, 2, 3]) as (proc, handle):
        proc.send_signal(signal.SIGSTOP)  # both pulls wait, their receives posted
        bystander = asyncio.ensure_future(client.pull("r1", handle, [4, 5, 6, 7], timeout=30.0))
        await asyncio.sleep(0.5)  # it made the endpoint (a fresh one, never reused)
        unwanted = asyncio.ensure_future(client.pull("r1", handle, [8, 9, 10, 11], timeout=30.0))
        await asyncio.sleep(0.5)
        unwanted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unwanted
        proc.send_signal(signal.SIGCONT)
        await bystander
        assert torch.equal(dst[4:8], peer_cache()[0:4])
        assert (dst[8:12] == -1).all()  # the cancelled pull's blocks: nothing landed
    await client.close()


def test_lease_expiry_and_pinning() -> None:
    now = [1000.0]
    freed: list[str] = []
    leases = LeaseTable(freed.append, clock=lambda: now[0])
    leases.add("a", [1, 2], 20, ttl=30)
    b = leases.add("b", [3], 5, ttl=30)
    leases.add("c", [4], 5, ttl=90)
    leases.pin(b)  # a transfer is reading b
    now[0] += 31
    assert sorted(leases.expire()) == ["a", "b"]
    assert freed == ["a"]  # b waits for its transfer to finish
    assert leases.get("b") is None  # but nobody new may start pulling it
    leases.unpin(b)
    assert freed == ["a", "b"]
    assert not leases.release("a")  # exactly once
    assert leases.release("c") and freed == ["a", "b", "c"]
    assert len(leases) == 0


async def test_abandoned_transfer_unpins_its_lease_once_released() -> None:
    """A puller that timed out cancelled its receives, so the server's sends would wait forever;
    when the puller lets the lease go, the server gives the transfer up and frees the blocks."""
    async with Pair() as p:
        p.lease("r1", list(range(16)), 16 * BLOCK)
        lease = p.leases.get("r1")
        ep = await p.server.endpoints.get(p.client.own_address())
        # what the server is left with: a rendezvous-sized send (256 KiB) nobody will receive
        send = asyncio.ensure_future(ep.send(torch.zeros(1 << 16).numpy(), tag=12, force_tag=True))
        p.leases.pin(lease)
        task = asyncio.ensure_future(p.server._send_all(send, lease))
        await asyncio.sleep(0.3)
        assert not task.done()
        assert p.leases.release("r1") and p.freed == []  # pinned: not freed yet
        with pytest.raises(KVTransferError, match="stopped receiving"):
            await asyncio.wait_for(task, 10)
        p.server.endpoints.drop(p.client.own_address(), ep)  # what _serve does: cancels the send
        p.leases.unpin(lease)
        assert p.freed == ["r1"]


async def test_timed_out_pull_leaves_the_lease_usable() -> None:
    async with Pair() as p:
        handle = p.lease("r1", list(range(16)), 16 * BLOCK)
        with pytest.raises(KVTransferError, match="timed out"):
            await p.client.pull("r1", handle, list(range(16, 32)), timeout=1e-4)
        await p.client.pull("r1", handle, list(range(16, 32)))
        assert torch.equal(p.dst[16:32], p.src[0:16])
