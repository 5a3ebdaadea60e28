"""Layer-wise streamed pulls over real ucxx on loopback (issue 29 item 3): the server holds each
layer group until prefill has written it, and the last piece until the first token exists."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.transfer import KVStreamFinished, KVTransferError, pull_streamed
from pdserve.shared.kv.transfer.stream import FINISHED, LayerStream, layer_groups
from tests.integration.kv_peer import LAYERS
from tests.integration.test_kv_transfer import Pair, fingerprint


def streamed(
    p: Pair, rid: str, blocks: list[int], num_tokens: int, done: int = 0
) -> tuple[KVHandle, LayerStream]:
    """A lease whose first ``done`` blocks were complete when it was taken."""
    stream = LayerStream(LAYERS, done_blocks=frozenset(blocks[:done]))
    lease = p.leases.add(rid, blocks, num_tokens, 30.0, stream=stream)
    handle = KVHandle(
        "prefill-0",
        p.server.address,
        blocks,
        num_tokens,
        fingerprint(),
        lease.expires,
        lease.token,
        streaming=True,
        ready_blocks=done,
    )
    return handle, stream


async def settle() -> None:
    for _ in range(20):  # a few loop turns: requests in, sends out, receives done
        await asyncio.sleep(0.005)


def test_layer_groups_cover_every_layer_once() -> None:
    assert layer_groups(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    assert layer_groups(2, 4) == [(0, 1), (1, 2)]
    assert layer_groups(5, 1) == [(0, 5)]


async def test_pieces_move_only_as_prefill_writes_them() -> None:
    assert LAYERS >= 2
    async with Pair() as p:
        src, dst = [3, 4, 9], [10, 11, 20]
        handle, stream = streamed(p, "r1", src, 3 * 4)
        real = p.src.clone()
        p.src[src] = 0.5  # "not computed yet": what the layers hold before prefill writes them
        pull = asyncio.ensure_future(pull_streamed(p.client, "r1", handle, dst, 10.0, groups=2))
        await settle()
        assert not pull.done() and (p.dst[dst] == -1).all()  # nothing is ready: nothing moved
        half = LAYERS // 2
        p.src[src, :half] = real[src, :half]
        stream.advance(half)
        await settle()
        assert torch.equal(p.dst[dst, :half], real[src, :half])  # the first group is in
        assert (p.dst[dst, half:] == -1).all() and not pull.done()
        p.src[src] = real[src]
        stream.advance(LAYERS)  # every layer written, but the first token is not sampled yet
        await settle()
        assert not pull.done()
        stream.finish(first_token=1234)
        stats = await asyncio.wait_for(pull, 5.0)
        assert stats.first_token == 1234
        assert torch.equal(p.dst[dst], real[src])
        assert stats.num_messages == 2 * len(src) and len(stats.piece_seconds) == 2
        assert stats.piece_seconds[0] < stats.piece_seconds[1]


async def test_a_request_finished_at_its_first_token_refuses_the_pieces() -> None:
    async with Pair() as p:
        handle, stream = streamed(p, "r1", [0, 1], 2 * 4)
        pull = asyncio.ensure_future(pull_streamed(p.client, "r1", handle, [5, 6], 10.0, groups=3))
        await settle()
        stream.advance(1)
        stream.end(FINISHED)
        with pytest.raises(KVStreamFinished):
            await asyncio.wait_for(pull, 5.0)
        # the refusals completed the posted receives: the endpoint goes on serving pulls
        again = p.lease("r2", [7, 8], 2 * 4)
        await p.client.pull("r2", again, [12, 13])
        assert torch.equal(p.dst[12:14], p.src[7:9])


async def test_a_pull_after_the_first_token_ended_the_request_hears_so() -> None:
    """The prefill worker released the lease before the decode worker's pull came (max_tokens
    1 seen in a CI run): the refusal still says the request finished, so the decode worker
    drops it instead of recomputing the prompt."""
    async with Pair() as p:
        handle, stream = streamed(p, "r1", [0, 1], 2 * 4)
        stream.end(FINISHED)
        p.leases.release("r1")
        assert p.freed == ["r1"]
        with pytest.raises(KVStreamFinished):
            await pull_streamed(p.client, "r1", handle, [5, 6], 10.0, groups=2)
        with pytest.raises(KVStreamFinished):
            await p.client.pull("r1", handle, [5, 6], 10.0)
        # a lease let go for another reason is still just gone
        handle, stream = streamed(p, "r2", [2, 3], 2 * 4)
        stream.end("aborted")
        p.leases.release("r2")
        with pytest.raises(KVTransferError, match="no lease") as caught:
            await p.client.pull("r2", handle, [5, 6], 10.0)
        assert not isinstance(caught.value, KVStreamFinished)


async def test_a_lease_let_go_mid_prefill_refuses_and_frees_after_the_pieces() -> None:
    async with Pair() as p:
        handle, stream = streamed(p, "r1", [0, 1], 2 * 4)
        pull = asyncio.ensure_future(pull_streamed(p.client, "r1", handle, [5, 6], 10.0, groups=2))
        await settle()
        assert p.leases.get("r1").pins == 2  # held pieces pin the blocks
        p.leases.release("r1")  # cancelled on the prefill worker
        with pytest.raises(KVTransferError, match="let go"):
            await asyncio.wait_for(pull, 5.0)
        assert p.freed == ["r1"]
        assert (p.dst[5:7] == -1).all()


async def test_a_bulk_pull_of_a_streamed_lease_waits_for_all_of_it() -> None:
    async with Pair() as p:
        handle, stream = streamed(p, "r1", [2, 3], 2 * 4)
        pull = asyncio.ensure_future(p.client.pull("r1", handle, [8, 9], 10.0))
        stream.advance(LAYERS)
        await settle()
        assert not pull.done()
        stream.finish(first_token=7)
        await asyncio.wait_for(pull, 5.0)
        assert torch.equal(p.dst[8:10], p.src[2:4])


async def test_blocks_complete_when_leased_move_before_any_layer_is_written() -> None:
    """Earlier chunks of a long prompt: their blocks go at once, every layer, in one piece."""
    async with Pair() as p:
        src, dst = [3, 4, 9], [10, 11, 20]
        handle, stream = streamed(p, "r1", src, 3 * 4, done=2)
        pull = asyncio.ensure_future(pull_streamed(p.client, "r1", handle, dst, 10.0, groups=2))
        await settle()
        assert torch.equal(p.dst[[10, 11]], p.src[[3, 4]]) and (p.dst[20] == -1).all()
        stream.advance(LAYERS)
        stream.finish(first_token=3)
        stats = await asyncio.wait_for(pull, 5.0)
        assert torch.equal(p.dst[dst], p.src[src]) and len(stats.piece_seconds) == 3


async def test_a_cancelled_pull_waits_for_the_refusal_and_keeps_the_endpoint() -> None:
    """A request that ends at its first token: the gateway cancels its decode leg while the
    server still holds the pieces (a race CI hit). The cancelled pull waits for the refusal's
    empty messages to complete its receives rather than aborting the endpoint it shares: the
    peer noticed such an abort late and failed the next request's pull on the endpoint made in
    its place, which then recomputed its prompt."""
    async with Pair() as p:
        handle, stream = streamed(p, "r1", [0, 1], 2 * 4)
        pull = asyncio.ensure_future(pull_streamed(p.client, "r1", handle, [5, 6], 10.0, groups=2))
        await settle()
        [ep] = p.client.endpoints.eps.values()
        pull.cancel()
        await settle()
        assert not pull.done()  # its receives are still posted: the blocks stay its own
        stream.end(FINISHED)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(pull, 5.0)
        assert list(p.client.endpoints.eps.values()) == [ep] and not ep.closed
        assert (p.dst[5:7] == -1).all()
        again = p.lease("r2", [7, 8], 2 * 4)
        await p.client.pull("r2", again, [12, 13])
        assert torch.equal(p.dst[12:14], p.src[7:9])
