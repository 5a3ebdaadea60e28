"""KV pulls over real ucxx on loopback, between two block-major caches."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shared.kv_transfer import (
    FingerprintMismatch,
    KVClient,
    KVServer,
    KVTransferError,
    LeaseTable,
    block_runs,
)
from shared.protocol import KVHandle

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
NUM_BLOCKS = 32


def fingerprint(dtype: torch.dtype = torch.float32) -> dict:
    return {
        "model": "tiny",
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": BLOCK,
        "num_layers": LAYERS,
        "num_kv_heads": HEADS,
        "head_dim": DIM,
    }


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
            "127.0.0.1",
            self.server.port,
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
        assert len(p.client._peers) == 1


async def test_fingerprint_mismatch_fails_before_connecting() -> None:
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    other = {**fingerprint(), "num_kv_heads": 4}
    handle = KVHandle("p", "127.0.0.1", 9, [0], 1, other, time.time() + 30, "t")  # port 9: nobody
    with pytest.raises(FingerprintMismatch, match="num_kv_heads"):
        await client.pull("r1", handle, [0])
    assert client._peers == {}
    assert (dst == -1).all()


async def test_server_checks_layout_token_and_lease_before_sending() -> None:
    async with Pair() as p:
        good = p.lease("r1", [0, 1], 2 * BLOCK)
        # a puller that claims a layout the server does not have
        liar = KVClient(p.dst, {**fingerprint(), "head_dim": 4}, BLOCK)
        bad_fp = KVHandle(**{**good.__dict__, "fingerprint": {**fingerprint(), "head_dim": 4}})
        with pytest.raises(KVTransferError, match="layout mismatch"):
            await liar.pull("r1", bad_fp, [5, 6])
        await liar.close()
        wrong_token = KVHandle(**{**good.__dict__, "token": "guess"})
        with pytest.raises(KVTransferError, match="wrong lease token"):
            await p.client.pull("r1", wrong_token, [5, 6])
        beyond = KVHandle(**{**good.__dict__, "block_ids": [0, 2]})  # block 2 is not leased
        with pytest.raises(KVTransferError, match="not part of the lease"):
            await p.client.pull("r1", beyond, [5, 6])
        with pytest.raises(KVTransferError, match="no lease"):
            await p.client.pull("r2", good, [5, 6])
        assert (p.dst == -1).all()  # nothing moved
        assert p.server.pulls_refused == 4
        # the endpoint is still in step after refusals: a good pull works
        await p.client.pull("r1", good, [5, 6])
        assert torch.equal(p.dst[5:7], p.src[0:2])


async def test_released_lease_cannot_be_pulled() -> None:
    async with Pair() as p:
        handle = p.lease("r1", [0], 1)
        assert p.leases.release("r1")
        assert p.freed == ["r1"]
        with pytest.raises(KVTransferError, match="no lease"):
            await p.client.pull("r1", handle, [3])


async def test_dead_server_fails_fast() -> None:
    async with Pair() as p:
        handle = p.lease("r1", [0], 1)
        await p.server.stop()
        p.client.connect_timeout = 1.0
        with pytest.raises(KVTransferError):
            await p.client.pull("r1", handle, [3], timeout=10.0)


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


async def test_timed_out_pull_leaves_server_and_lease_usable() -> None:
    async with Pair() as p:
        warm = p.lease("r0", [31], 1)
        await p.client.pull("r0", warm, [0])  # the endpoint exists: the timeout hits the pull
        handle = p.lease("r1", list(range(16)), 16 * BLOCK)
        with pytest.raises(KVTransferError, match="timed out"):
            await p.client.pull("r1", handle, list(range(16, 32)), timeout=1e-4)
        assert p.client._peers == {}  # the half-used endpoint is gone
        # the server notices the dead endpoint; the lease is not left pinned
        for _ in range(100):
            if p.leases.leases["r1"].pins == 0:
                break
            await asyncio.sleep(0.01)
        assert p.leases.leases["r1"].pins == 0
        await p.client.pull("r1", handle, list(range(16, 32)))
        assert torch.equal(p.dst[16:32], p.src[0:16])


async def test_stale_endpoint_reconnects_once() -> None:
    """The prefill side dropped the connection the puller keeps (restart, network blip): one
    fresh connection is tried before the pull counts as failed."""
    async with Pair() as p:
        await p.client.pull("r0", p.lease("r0", [1], 1), [2])
        for ep in list(p.server._endpoints):
            ep.abort()
        # no pause: the puller has not noticed yet and tries its kept endpoint first
        await p.client.pull("r1", p.lease("r1", [3, 4], 2 * BLOCK), [5, 6])
        assert torch.equal(p.dst[5:7], p.src[3:5])
