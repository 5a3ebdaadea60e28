"""--kv-checksum's hashes (shared/kv/transfer/checksum.py), model-free and without UCX: one xxh3
per (block, KV head) that every TP layout of the same KV agrees on, float and quantized; a damaged
byte is found and named; the hashes a server took at lease time answer any head slice."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from pdserve.shared.kv.tp_layout import kv_head_range
from pdserve.shared.kv.transfer import KVChecksumError, KVTransferError, LeaseTable
from pdserve.shared.kv.transfer.checksum import KVHasher, LeaseSums, hash_lease, lease_sums
from pdserve.shared.kv.transfer.heads import HeadSlicer
from pdserve.shared.kv.transfer.wire import pack_reply, reply_sums, unpack_reply

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 2, 4, 4, 8, 6
FP = {"num_kv_heads": HEADS}


def spec(heads: int):
    return kv_cache_spec("int8", torch.float32, LAYERS, BLOCK, heads, DIM)


def split_of(quantized: bool, heads: int):
    return (lambda s: [t for t in spec(heads).split(s) if t is not None]) if quantized else None


def full_cache(quantized: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    if not quantized:
        return torch.randn((NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS, DIM), generator=gen)
    storage = torch.zeros((NUM_BLOCKS, spec(HEADS).bytes_per_block), dtype=torch.uint8)
    values, scales = split_of(True, HEADS)(storage)
    values.copy_(torch.randint(-128, 128, values.shape, generator=gen, dtype=torch.int8))
    scales.copy_(torch.rand(scales.shape, generator=gen))
    return storage


def cut(full: torch.Tensor, quantized: bool, lo: int, hi: int) -> torch.Tensor:
    """A rank's cache: heads [lo, hi) of ``full``."""
    if not quantized:
        return full[:, :, :, :, lo:hi].contiguous()
    out = torch.zeros((NUM_BLOCKS, spec(hi - lo).bytes_per_block), dtype=torch.uint8)
    mine, theirs = split_of(True, hi - lo)(out), split_of(True, HEADS)(full)
    for m, t in zip(mine, theirs, strict=True):
        m.copy_(t[:, :, :, :, lo:hi])
    return out


def hasher(cache: torch.Tensor, quantized: bool, heads=None) -> KVHasher:
    n = HEADS if heads is None else heads[1] - heads[0]
    return KVHasher(cache, HeadSlicer(cache, FP, heads, split_of(quantized, n)))


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_every_tp_layout_hashes_a_head_alike(quantized: bool, tp: int) -> None:
    full = full_cache(quantized)
    blocks = [4, 0, 3]
    whole = hasher(full, quantized).hash_blocks(blocks, (0, HEADS))
    assert whole.shape == (3, HEADS) and whole.dtype == np.uint64
    assert len({int(h) for h in whole.flat}) == whole.size  # no two units alike
    for rank in range(tp):
        lo, hi = kv_head_range(HEADS, tp, rank)
        shard = hasher(cut(full, quantized, lo, hi), quantized, (lo, hi))
        assert np.array_equal(shard.hash_blocks(blocks, (lo, hi)), whole[:, lo:hi])
        if hi - lo > 1:  # a slice of a shard, as a pull plan may ask
            assert np.array_equal(shard.hash_blocks(blocks, (lo + 1, hi)), whole[:, lo + 1 : hi])


@pytest.mark.parametrize("quantized", [False, True])
def test_a_damaged_byte_is_found_and_named(quantized: bool) -> None:
    src = full_cache(quantized)
    dst = src.clone()
    want = hasher(src, quantized).hash_blocks([1, 2], (0, HEADS))
    check = hasher(dst, quantized)
    check.verify([(1, 2)], (0, HEADS), want, "p0")  # equal: silent
    parts = split_of(quantized, HEADS)(dst) if quantized else [dst]
    # one byte of block 2, head 3, in the last part (the scales of a quantized cache)
    parts[-1][2, 1, 0, 0, 3].view(torch.uint8)[0] ^= 0x10
    got = check.hash_blocks([1, 2], (0, HEADS))
    assert [tuple(ij) for ij in np.argwhere(got != want)] == [(1, 3)]
    with pytest.raises(KVChecksumError, match="1 of 8 .* block 2 head 3"):
        check.verify([(1, 2)], (0, HEADS), want, "p0")
    assert issubclass(KVChecksumError, KVTransferError)  # the failure policy handles it


def test_opaque_storage_has_one_unit_per_block() -> None:
    storage = torch.randint(0, 255, (NUM_BLOCKS, 64), dtype=torch.uint8)
    h = KVHasher(storage, HeadSlicer(storage, FP))
    assert h.units((0, HEADS)) == 1
    sums = h.hash_blocks([0, 5], (0, HEADS))
    assert sums.shape == (2, 1)
    storage[5, 63] ^= 1
    assert h.hash_blocks([0, 5], (0, HEADS))[1, 0] != sums[1, 0]


async def test_lease_time_hashes_answer_any_head_slice() -> None:
    full = full_cache(False)
    lo, hi = kv_head_range(HEADS, 2, 1)
    shard = hasher(cut(full, False, lo, hi), False, (lo, hi))
    table = LeaseTable(lambda rid: None)
    table.on_add = lambda lease: hash_lease(shard, lease)
    lease = table.add("r1", [5, 1, 2], 3 * BLOCK, 30.0)
    assert isinstance(lease.checksums, asyncio.Future)  # taken in a thread, not awaited here
    whole = hasher(full, False).hash_blocks([1, 2], (0, HEADS))
    got = await lease_sums(shard, lease, [[1, 2]], (lo + 1, hi))
    assert np.array_equal(got, whole[:, lo + 1 : hi]) and got.flags.c_contiguous
    assert isinstance(lease.checksums.result(), LeaseSums)
    lease.checksums = None  # a lease the server did not hash: hashed when sent
    assert np.array_equal(await lease_sums(shard, lease, [[1, 2]], (lo, hi)), whole[:, lo:hi])


def test_hash_lease_outside_an_event_loop_hashes_at_once() -> None:
    full = full_cache(False)
    h = hasher(full, False)
    table = LeaseTable(lambda rid: None)
    table.on_add = lambda lease: hash_lease(h, lease)
    lease = table.add("r1", [3], BLOCK, 30.0)
    assert np.array_equal(lease.checksums.table, h.hash_blocks([3], (0, HEADS)))


def test_reply_says_how_many_checksums_follow() -> None:
    assert reply_sums(pack_reply(None)) == 0
    assert reply_sums(pack_reply(None, sliced=True, sums=2)) == 2
    assert unpack_reply(pack_reply(None, sums=300)) is None  # still a yes
    refusal = pack_reply("no lease for r1")
    assert reply_sums(refusal) == 0 and unpack_reply(refusal) == "no lease for r1"
