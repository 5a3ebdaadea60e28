"""Head-sliced KV pulls over real ucxx on loopback, between workers of different TP sizes: every
rank's cache holds only its KV heads, cut from one "full" cache, and after each decode rank
pulled its ``pull_plan`` its cache must equal the same cut of the full cache exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from pdserve.services.engine.quant.kv_cache import KVCacheSpec, kv_cache_spec
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.tp_layout import TP_KEY, kv_head_range, pull_plan
from pdserve.shared.kv.transfer import (
    FingerprintMismatch,
    KVClient,
    KVServer,
    KVTransferError,
    LeaseTable,
    block_runs,
)

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 2, 4, 4, 8, 16
SRC = [3, 4, 5, 9, 10, 12]  # leased prefill blocks: three runs
DST = [7, 8, 9, 1, 2, 14]
NUM_TOKENS = 5 * BLOCK + 1  # the last block partly filled: all six travel
Split = Callable[[torch.Tensor], list[torch.Tensor]]


def fingerprint(tp: int, quantized: bool) -> dict:
    fp = {
        "model": "tiny",
        "dtype": "float32",
        "block_size": BLOCK,
        "num_layers": LAYERS,
        "num_kv_heads": HEADS,
        "head_dim": DIM,
        TP_KEY: tp,
    }
    return {**fp, **spec(HEADS).fingerprint()} if quantized else fp


def spec(heads: int) -> KVCacheSpec:
    return kv_cache_spec("int8", torch.float32, LAYERS, BLOCK, heads, DIM)


class Layout:
    """A float or int8 cache of ``heads`` KV heads: its storage and its parts."""

    def __init__(self, quantized: bool) -> None:
        self.quantized = quantized

    def empty(self, heads: int) -> torch.Tensor:
        if not self.quantized:
            return torch.full((NUM_BLOCKS, LAYERS, 2, BLOCK, heads, DIM), -1.0)
        return torch.full((NUM_BLOCKS, spec(heads).bytes_per_block), 0xEE, dtype=torch.uint8)

    def split(self, heads: int) -> Split | None:
        if not self.quantized:
            return None
        return lambda s: [t for t in spec(heads).split(s) if t is not None]

    def parts(self, storage: torch.Tensor, heads: int) -> list[torch.Tensor]:
        split = self.split(heads)
        return [storage] if split is None else split(storage)

    def random_full(self) -> torch.Tensor:
        full = self.empty(HEADS)
        gen = torch.Generator().manual_seed(11)
        if not self.quantized:
            return full.copy_(torch.randn(full.shape, generator=gen))
        values, scales = self.parts(full, HEADS)
        values.copy_(torch.randint(-128, 128, values.shape, generator=gen, dtype=torch.int8))
        scales.copy_(torch.rand(scales.shape, generator=gen) + 0.5)
        return full

    def cut(self, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """A rank's own cache: heads ``[lo, hi)`` of ``full``."""
        out = self.empty(hi - lo)
        for mine, theirs in zip(self.parts(out, hi - lo), self.parts(full, HEADS), strict=True):
            mine.copy_(theirs[:, :, :, :, lo:hi])
        return out


class PrefillSide:
    """The ranks of a prefill worker of TP ``tp``, each a KVServer over its heads of ``full``,
    each with its own lease table holding the same lease (the same token)."""

    def __init__(self, layout: Layout, full: torch.Tensor, tp: int) -> None:
        self.tp, self.quantized = tp, layout.quantized
        self.ranges = [kv_head_range(HEADS, tp, r) for r in range(tp)]
        self.leases = [LeaseTable(lambda rid: None) for _ in range(tp)]
        self.servers = [
            KVServer(
                layout.cut(full, lo, hi),
                fingerprint(tp, layout.quantized),
                table,
                heads=(lo, hi),
                split=layout.split(hi - lo),
            )
            for (lo, hi), table in zip(self.ranges, self.leases, strict=True)
        ]

    async def __aenter__(self) -> PrefillSide:
        for server in self.servers:
            await server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for server in self.servers:
            await server.stop()

    def lease(self, rid: str) -> KVHandle:
        """The handle the prefill worker publishes: rank 0's address, the shared token."""
        first = self.leases[0].add(rid, SRC, NUM_TOKENS, 30.0)
        for table in self.leases[1:]:
            table.add(rid, SRC, NUM_TOKENS, 30.0).token = first.token
        fp = fingerprint(self.tp, self.quantized)
        address = self.servers[0].address
        return KVHandle("prefill-0", address, SRC, NUM_TOKENS, fp, first.expires, first.token)


def decode_side(layout: Layout, tp: int) -> list[KVClient]:
    clients = []
    for rank in range(tp):
        lo, hi = kv_head_range(HEADS, tp, rank)
        fp = fingerprint(tp, layout.quantized)
        cache = layout.empty(hi - lo)
        clients.append(KVClient(cache, fp, BLOCK, heads=(lo, hi), split=layout.split(hi - lo)))
    return clients


async def pull_all(prefill: PrefillSide, clients: list[KVClient], handle: KVHandle) -> list:
    """Every decode rank pulls every piece of its plan, all at once."""
    pulls = [
        client.pull(
            "r1",
            handle,
            DST,
            address=prefill.servers[piece.prefill_rank].address,
            heads=(piece.lo, piece.hi),
        )
        for rank, client in enumerate(clients)
        for piece in pull_plan(HEADS, prefill.tp, len(clients), rank)
    ]
    return await asyncio.gather(*pulls)


def assert_pulled(layout: Layout, full: torch.Tensor, clients: list[KVClient]) -> None:
    for client in clients:
        lo, hi = client.slicer.heads
        want = layout.cut(full, lo, hi)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(DST))
        assert torch.equal(client.kv_cache[DST], want[SRC]), (lo, hi)
        assert torch.equal(client.kv_cache[untouched], layout.empty(hi - lo)[untouched])


@pytest.mark.parametrize(
    ("quantized", "prefill_tp", "decode_tp"),
    [(False, 2, 1), (False, 1, 2), (False, 2, 2), (True, 1, 2), (True, 2, 1), (True, 1, 1)],
)
async def test_decode_ranks_pull_exactly_their_heads(
    quantized: bool, prefill_tp: int, decode_tp: int
) -> None:
    layout = Layout(quantized)
    full = layout.random_full()
    clients = decode_side(layout, decode_tp)
    async with PrefillSide(layout, full, prefill_tp) as prefill:
        stats = await pull_all(prefill, clients, prefill.lease("r1"))
        assert_pulled(layout, full, clients)
        row_bytes = full[0].numel() * full.element_size()
        moved = sum(s.num_bytes for s in stats)
        assert moved == len(SRC) * row_bytes  # every head of every block, once
        runs = len(block_runs(SRC, DST))
        assert all(s.num_messages == runs and s.num_blocks == len(SRC) for s in stats)
        assert sum(server.pulls_served for server in prefill.servers) == len(stats)
    for client in clients:
        await client.close()


@pytest.mark.parametrize("quantized", [False, True])
async def test_equal_ranges_move_whole_blocks_without_copies(quantized: bool, monkeypatch) -> None:
    """TP 2 -> 2 (and a quantized TP 1 -> 1): the bytes of the blocks, straight from the cache."""
    layout = Layout(quantized)
    full = layout.random_full()
    tp = 1 if quantized else 2
    clients = decode_side(layout, tp)
    async with PrefillSide(layout, full, tp) as prefill:
        for side in (*prefill.servers, *clients):
            monkeypatch.setattr(side, "slicer", NoSlicing(side.slicer))
        await pull_all(prefill, clients, prefill.lease("r1"))
        assert_pulled(layout, full, clients)
    for client in clients:
        await client.close()


class NoSlicing:
    """A HeadSlicer that fails any head-sliced packing or landing."""

    def __init__(self, slicer) -> None:
        self.heads, self.full, self.parts = slicer.heads, slicer.full, slicer.parts
        self.requested = slicer.requested

    def pack(self, *args) -> None:
        raise AssertionError("packed a head slice")

    landing = unpack = pack


async def test_server_refuses_heads_it_does_not_hold() -> None:
    layout = Layout(False)
    full = layout.random_full()
    (client,) = decode_side(layout, 1)
    async with PrefillSide(layout, full, 2) as prefill:
        handle = prefill.lease("r1")
        rank0 = prefill.servers[0].address
        for heads in [(0, 4), (2, 4), (1, 3)]:  # rank 0 holds [0, 2) only
            with pytest.raises(KVTransferError, match="not all held here"):
                await client.pull("r1", handle, DST, address=rank0, heads=heads)
        assert prefill.servers[0].pulls_refused == 3
        assert (client.kv_cache == -1).all()  # nothing moved
        with pytest.raises(KVTransferError, match="not all held here"):  # beyond our own heads
            await client.pull("r1", handle, DST, address=rank0, heads=(3, 5))
        with pytest.raises(KVTransferError, match="not all held here"):  # empty
            await client.pull("r1", handle, DST, address=rank0, heads=(1, 1))
        await pull_all(prefill, [client], handle)  # the lease is still good
        assert_pulled(layout, full, [client])
    await client.close()


async def test_layouts_that_differ_beyond_tp_still_mismatch() -> None:
    layout = Layout(False)
    (client,) = decode_side(layout, 1)
    async with PrefillSide(layout, layout.random_full(), 2) as prefill:
        handle = prefill.lease("r1")
        other = KVHandle(**{**handle.__dict__, "fingerprint": {**handle.fingerprint, "dtype": "x"}})
        with pytest.raises(FingerprintMismatch, match="dtype"):
            await client.pull("r1", other, DST, heads=(0, 2))
        assert len(client.endpoints) == 0
    await client.close()
