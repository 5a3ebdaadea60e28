"""Block generations on a real engine and a real UCX pull (issue 47): a lease records the highest
generation of its blocks; once one of them is freed and taken again - here forced, by giving the
blocks back to the engine while the lease table still holds the lease, as a lost release or a
leaked token would - the KV server refuses the pull instead of serving another request's KV."""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.transfer import KVClient, KVServer, KVTransferError, LeaseTable
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, step_outputs

BLOCK = 4
BLOCKS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)  # more than one: the KV is parked


def prefill(engine, bus_id: str, prompt: list[int]) -> list[int]:
    """Prefill ``prompt``; the parked sequence's block ids."""
    engine.add_request(bus_id, prompt, GREEDY)
    for _ in range(16):
        for out in step_outputs(engine):
            if out.bus_id == bus_id and out.kv_block_ids is not None:
                return list(out.kv_block_ids)
    raise AssertionError(f"{bus_id} was not prefilled")


class Side:
    """The prefill engine's KV server over its cache, leases read against its generations."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.leases = LeaseTable(
            on_free=lambda bus_id: None, generations=engine.block_manager.generations
        )
        fingerprint = engine.layout_fingerprint()
        self.server = KVServer(
            engine.kv_cache, fingerprint, self.leases, heads=engine.kv_heads, split=engine.kv_split
        )
        self.dst = torch.zeros_like(engine.kv_cache)
        self.client = KVClient(
            self.dst, fingerprint, BLOCK, heads=engine.kv_heads, split=engine.kv_split
        )

    def handle(self, bus_id: str, blocks: list[int], num_tokens: int) -> KVHandle:
        lease = self.leases.add(bus_id, blocks, num_tokens, ttl=30.0)
        return KVHandle(
            worker_id="prefill-0",
            ucx_address=self.server.address,
            block_ids=blocks,
            num_tokens=num_tokens,
            fingerprint=self.engine.layout_fingerprint(),
            lease_expires=lease.expires,
            token=lease.token,
            epoch=lease.epoch or 0,
        )


@pytest.fixture
async def side(llama_dir):
    engine = make_engine(
        llama_dir, num_kv_blocks=BLOCKS, block_size=BLOCK, prefill_only=True, prefix_cache=False
    )
    s = Side(engine)
    await s.server.start()
    yield s
    await s.client.close()
    await s.server.stop()


async def test_a_pull_of_blocks_reused_since_the_lease_is_refused(side: Side) -> None:
    first = list(range(5, 5 + 3 * BLOCK))  # 3 blocks
    blocks = prefill(side.engine, "a", first)
    handle = side.handle("a", blocks, len(first))
    assert handle.epoch == int(side.engine.block_manager.generations[blocks].max()) > 0
    dst = list(range(BLOCKS - len(blocks), BLOCKS))
    await side.client.pull("a", handle, dst)  # the lease as taken: served
    assert torch.equal(side.dst[dst], side.engine.kv_cache[blocks])

    # The bug being guarded against: the blocks go back to the engine while the lease stays in
    # the table. A prompt that needs six of the eight blocks then takes some of them (the free
    # list hands out the least recently freed first) and writes its own KV there.
    side.engine.release("a")
    step_outputs(side.engine)
    second = list(range(50, 50 + 6 * BLOCK - 1))
    reused = prefill(side.engine, "b", second)
    assert set(blocks) & set(reused)
    assert side.leases.get("a") is not None  # the table still says "a" may be pulled
    side.dst.zero_()
    with pytest.raises(KVTransferError, match="reused since the lease"):
        await side.client.pull("a", handle, dst)
    assert not side.dst.any()  # not one byte of b's KV reached a's puller


async def test_a_pull_showing_another_epoch_is_refused(side: Side) -> None:
    prompt = list(range(7, 7 + 2 * BLOCK))
    blocks = prefill(side.engine, "c", prompt)
    handle = side.handle("c", blocks, len(prompt))
    stale = KVHandle(**{**handle.__dict__, "epoch": handle.epoch - 1})
    with pytest.raises(KVTransferError, match="lease epoch"):
        await side.client.pull("c", stale, [0, 1])
    await side.client.pull("c", handle, [0, 1])
    assert torch.equal(side.dst[[0, 1]], side.engine.kv_cache[blocks])
