"""The KV offload tiers on their own (services/engine/kv_tiers): block files, host memory's LRU
slots, the disk tier's files, index rebuild and checks, and the two together. Real files in a
temporary directory, CPU tensors; the engine with tiers on is tests/engine/test_kv_offload.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.services.engine.kv_tiers import DISK, HOST, KVTiers
from pdserve.services.engine.kv_tiers.block_file import (
    HEADER,
    BadBlockFile,
    file_name,
    parse_name,
    read_block,
    write_block,
)
from pdserve.services.engine.kv_tiers.disk import DiskTier
from pdserve.services.engine.kv_tiers.host import HostTier

LAYOUT, OTHER = "0123456789abcdef", "fedcba9876543210"
BLOCK = 64  # bytes per block
CPU = torch.device("cpu")


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def loaded(disk: DiskTier, hashes: list[int]) -> tuple[list[np.ndarray] | None, str]:
    """Claim and load ``hashes`` from ``disk``, waiting for the disk thread."""
    got: list = []
    done = threading.Event()
    assert all(disk.claim(h) for h in hashes)
    disk.load(hashes, lambda blocks, error: (got.append((blocks, error)), done.set()))
    assert done.wait(5)
    return got[0]


# ---- block files --------------------------------------------------------------------------------


def test_block_file_round_trip_and_every_check(tmp_path: Path) -> None:
    path = tmp_path / file_name(0xABC, LAYOUT)
    assert parse_name(path.name, LAYOUT) == 0xABC and parse_name(path.name, OTHER) is None
    write_block(path, LAYOUT, 0xABC, payload(1))
    assert not list(tmp_path.glob("*.tmp"))  # renamed into place
    assert np.array_equal(read_block(path, LAYOUT, 0xABC, BLOCK), payload(1))
    assert path.stat().st_size == HEADER.size + BLOCK

    def kind(mutate) -> str:
        write_block(path, LAYOUT, 0xABC, payload(1))
        data = bytearray(path.read_bytes())
        path.write_bytes(mutate(data))
        with pytest.raises(BadBlockFile) as exc:
            read_block(path, LAYOUT, 0xABC, BLOCK)
        return exc.value.kind

    def flip(at: int):
        return lambda d: d[:at] + bytes([d[at] ^ 1]) + d[at + 1 :]

    assert kind(flip(HEADER.size + 5)) == "corrupt"  # a payload bit: the checksum
    assert kind(lambda d: d[:-3]) == "torn"
    assert kind(lambda d: d[:10]) == "torn"
    assert kind(flip(0)) == "corrupt"  # magic
    assert kind(lambda d: d[:8] + bytes.fromhex(OTHER) + d[16:]) == "foreign"
    write_block(path, LAYOUT, 0xABC, payload(1))
    with pytest.raises(BadBlockFile, match="not the one it is named by"):
        read_block(path, LAYOUT, 0xABD, BLOCK)


# ---- host memory --------------------------------------------------------------------------------


def test_host_tier_is_lru_and_never_reuses_a_pinned_slot() -> None:
    host = HostTier(3 * BLOCK, BLOCK, pinned=False)
    slots = {h: host.store(h) for h in (1, 2, 3)}
    assert sorted(slots.values()) == [0, 1, 2] and len(host) == 3
    assert host.store(2) is None  # already here: only touched, now the newest
    pinned = host.claim(1)  # a load will read its slot (and it is used: newest)
    assert host.store(4) == slots[3]  # 3 was the least recently used: its slot is reused
    assert list(host.index) == [2, 1, 4]
    host.store(5)
    host.store(6)  # 1 is the oldest now, but pinned: 4 goes instead
    assert list(host.index) == [1, 5, 6] and host.index[1] == pinned
    host.unpin(pinned)
    host.store(7)
    assert list(host.index) == [5, 6, 7]


def test_host_tier_drops_a_block_when_every_slot_is_being_written() -> None:
    host = HostTier(2 * BLOCK, BLOCK, pinned=False)
    for h in (1, 2):
        host.pin(host.store(h))  # write-through: busy until the disk thread is done
    assert host.store(3) is None and 3 not in host and list(host.index) == [1, 2]
    host.release(host.index[1])  # from the disk thread
    assert host.store(3) is not None and list(host.index) == [2, 3]


# ---- disk ---------------------------------------------------------------------------------------


def test_disk_tier_writes_loads_and_evicts_least_recently_used(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * (HEADER.size + BLOCK), BLOCK, LAYOUT)
    released = []
    for h in (1, 2, 3):
        disk.put(h, payload(h), lambda h=h: released.append(h))
        assert h in disk  # indexed at once, before the write ran
    disk.flush()
    assert released == [1, 2, 3] and disk.counts.written == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_name(h, LAYOUT) for h in (1, 2, 3)]
    blocks, error = loaded(disk, [1, 2])  # 1 and 2 used: 3 is now the oldest
    assert error == "" and all(
        np.array_equal(b, payload(h)) for b, h in zip(blocks, (1, 2), strict=True)
    )
    disk.put(4, payload(4), lambda: None)
    disk.flush()
    assert 3 not in disk and not (tmp_path / file_name(3, LAYOUT)).exists()
    assert {1, 2, 4} == {parse_name(p.name, LAYOUT) for p in tmp_path.iterdir()}
    disk.close()


def test_a_claimed_block_outlives_eviction_until_loaded(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2 * (HEADER.size + BLOCK), BLOCK, LAYOUT)
    for h in (1, 2):
        disk.put(h, payload(h), lambda: None)
    assert disk.claim(1)
    disk.put(3, payload(3), lambda: None)  # over capacity: 2 goes, though 1 is older
    assert 1 in disk and 2 not in disk
    got = []
    disk.load([1], lambda blocks, error: got.append(blocks))
    disk.flush()
    assert np.array_equal(got[0][0], payload(1))
    disk.close()


def test_restart_rebuilds_the_index_and_removes_what_must_not_serve(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, BLOCK, LAYOUT)
    for h in range(1, 6):
        disk.put(h, payload(h), lambda: None)
    disk.close()
    (tmp_path / (file_name(6, LAYOUT) + ".tmp")).write_bytes(b"half a write")
    torn = tmp_path / file_name(2, LAYOUT)
    torn.write_bytes(torn.read_bytes()[:-1])
    bad_magic = tmp_path / file_name(3, LAYOUT)
    bad_magic.write_bytes(b"XXXX" + bad_magic.read_bytes()[4:])
    # another layout's files: one under its own name, one renamed to ours (header says other)
    write_block(tmp_path / file_name(7, OTHER), OTHER, 7, payload(7))
    write_block(tmp_path / file_name(8, LAYOUT), OTHER, 8, payload(8))
    # a payload flipped on disk: the header is fine, only the checksum at load tells
    flipped = tmp_path / file_name(4, LAYOUT)
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(data)
    for h in (1, 4, 5):  # modification times give the LRU order back
        past = time.time() - 100 + h
        os.utime(tmp_path / file_name(h, LAYOUT), (past, past))

    again = DiskTier(tmp_path, 1 << 20, BLOCK, LAYOUT)
    again.flush()
    assert list(again._index) == [1, 4, 5]  # oldest first, as their files' times say
    assert again.counts.corrupt_removed == 3  # the temporary, the torn file, the bad magic
    assert again.counts.foreign_ignored == 2
    assert (tmp_path / file_name(7, OTHER)).exists() and (tmp_path / file_name(8, LAYOUT)).exists()
    assert not torn.exists() and not bad_magic.exists()
    blocks, error = loaded(again, [1])
    assert np.array_equal(blocks[0], payload(1))
    blocks, error = loaded(again, [5, 4])
    assert blocks is None and "checksum" in error  # never served
    assert 4 not in again and not flipped.exists() and again.counts.corrupt_removed == 4
    again.close()


def test_restart_over_a_smaller_capacity_keeps_the_newest(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, BLOCK, LAYOUT)
    for h in range(1, 5):
        disk.put(h, payload(h), lambda: None)
        disk.flush()
        os.utime(tmp_path / file_name(h, LAYOUT), (1000.0 + h, 1000.0 + h))
    disk.close()
    small = DiskTier(tmp_path, 2 * (HEADER.size + BLOCK), BLOCK, LAYOUT)
    small.flush()
    assert list(small._index) == [3, 4] and len(list(tmp_path.iterdir())) == 2
    small.close()


# ---- both tiers ---------------------------------------------------------------------------------


def test_tiers_store_spill_claim_load_and_persist(tmp_path: Path) -> None:
    tiers = KVTiers(BLOCK, LAYOUT, 16 * BLOCK, CPU, tmp_path, 1 << 20)
    blocks = {h: torch.from_numpy(payload(h)) for h in range(40)}
    for h, src in blocks.items():
        tiers.store(h, src)
        if h % 4 == 3:  # as the engine does once per step: the writes go out only now
            tiers.settle()
            tiers.disk.flush()
    stats = tiers.stats()
    assert stats.stored == stats.to_disk == stats.disk.written == stats.disk_blocks == 40
    assert stats.dropped == 0 and stats.host_blocks == 16
    assert tiers.where(39) == HOST and tiers.where(0) == DISK and tiers.where(999) is None
    dst = torch.zeros(BLOCK, dtype=torch.uint8)
    claim = tiers.claim(39)
    tiers.load_host(claim, dst)
    assert torch.equal(dst, blocks[39]) and tiers.counts.host_hits == 1
    claim = tiers.claim(0)
    assert claim.slow and tiers.counts.disk_hits == 1
    got = []
    tiers.load_disk([claim], lambda b, e: got.append(b))
    tiers.disk.flush()
    assert np.array_equal(got[0][0], payload(0))
    tiers.store(40, torch.from_numpy(payload(40)))
    tiers.close()  # posts the last write and waits for it

    restarted = KVTiers(BLOCK, LAYOUT, 16 * BLOCK, CPU, tmp_path, 1 << 20)
    restarted.disk.flush()
    assert all(restarted.where(h) == DISK for h in range(41))
    restarted.close()


def test_without_disk_host_memory_reuses_its_oldest_slot() -> None:
    tiers = KVTiers(BLOCK, LAYOUT, 4 * BLOCK, CPU)
    for h in range(10):
        tiers.store(h, torch.full((BLOCK,), h, dtype=torch.uint8))
    tiers.settle()
    assert [tiers.where(h) for h in range(10)] == [None] * 6 + [HOST] * 4
    assert tiers.stats().stored == 10 and tiers.stats().dropped == 0


def test_clearing_the_tiers_forgets_every_block_and_deletes_its_files(tmp_path: Path) -> None:
    """``reset_external``: host memory and disk empty, the files gone (after the writes posted
    before the clear, so none is left behind), a removal event per block and tier; a restart
    finds nothing, and the tiers fill again as before."""
    tiers = KVTiers(BLOCK, LAYOUT, 4 * BLOCK, CPU, tmp_path, 1 << 20)
    tiers.enable_events()
    for h in range(4):
        tiers.store(h, torch.from_numpy(payload(h)))
    tiers.flush()  # 0-3 written: their slots come free at the next store
    gate = threading.Event()
    tiers.disk._jobs.put(gate.wait)  # the writes of 4-7 are posted but cannot run yet
    for h in range(4, 8):
        tiers.store(h, torch.from_numpy(payload(h)))
    tiers.settle()
    assert tiers.clear() == 8
    gate.set()
    tiers.flush()
    assert [tiers.where(h) for h in range(8)] == [None] * 8
    assert not list(tmp_path.glob("*.kv"))
    removed = {(tier, h) for tier, stored, h in tiers.log.take() if not stored}
    assert {(HOST, h) for h in range(4)} <= removed  # forgotten by host memory's LRU
    assert {(HOST, h) for h in range(4, 8)} | {(DISK, h) for h in range(8)} <= removed
    tiers.store(20, torch.from_numpy(payload(20)))
    tiers.settle()
    tiers.close()
    restarted = KVTiers(BLOCK, LAYOUT, 4 * BLOCK, CPU, tmp_path, 1 << 20)
    restarted.disk.flush()
    assert restarted.where(20) == DISK and restarted.stats().disk_blocks == 1
    restarted.close()
