"""The KV event stream of a real engine with offload tiers on (issue 33): what a consumer builds
from the feed's per-tier events alone is what each tier holds; a block the pool evicts is a
move (removed from the device, stored in host memory), a disk block counts once its file is
written and stops counting when its file is evicted or found corrupt; a feed opened after the
disk's start-up scan starts from what the scan found."""

from __future__ import annotations

from pathlib import Path

from tests.engine.test_kv_offload import (
    FILLERS,
    GREEDY,
    POOL,
    PROMPTS,
    block_gib,
    prefix_files,
    restart_setup,
    run_one,
)
from tests.engine_support import make_engine

TIERS = ("device", "host", "disk")


class Consumer:
    """What a gateway keeps: per tier, the hashes the deltas said are there."""

    def __init__(self, feed) -> None:
        self.feed = feed
        self.held = {t: set(feed.snapshot(t)) for t in feed.tiers}
        self.seen: set[int] = set().union(*self.held.values())
        self.log: list[tuple[str, list[int], list[int]]] = []  # per drain: tier, stored, removed

    def drain(self) -> None:
        for tier in self.feed.tiers:
            stored, removed = self.feed.drain(tier)
            assert not set(stored) & set(removed)  # the net change: disjoint
            self.held[tier].difference_update(removed)
            self.held[tier].update(stored)
            self.seen.update(stored, removed)
            self.log.append((tier, stored, removed))

    def stored(self, tier: str) -> set[int]:
        """Every hash a delta of ``tier`` said was stored."""
        return {h for t, stored, _ in self.log if t == tier for h in stored}

    def removed(self, tier: str) -> set[int]:
        return {h for t, _, removed in self.log if t == tier for h in removed}


def assert_matches_tiers(engine, consumer: Consumer, directory: Path) -> None:
    """The consumer's picture is what each tier holds now, hash for hash."""
    tiers = engine.offload.tiers
    assert consumer.held["device"] == set(engine.block_manager.hash_to_block)
    assert consumer.held["host"] == set(tiers.host.index)
    assert {h for h in consumer.seen if h in tiers.disk} == consumer.held["disk"]
    assert len(tiers.disk) == len(consumer.held["disk"])
    assert len(list(directory.glob("*.kv"))) == len(consumer.held["disk"])  # files, after flush


def test_events_carry_the_tiers_and_converge(llama_dir, tmp_path):
    one = block_gib(llama_dir)
    # few blocks in host memory and on disk: both tiers evict too
    engine = make_engine(
        llama_dir,
        num_kv_blocks=POOL,
        kv_offload_ram_gib=6 * one,
        kv_offload_disk=str(tmp_path),
        kv_offload_disk_gib=14 * one,
    )
    feed = engine.kv_event_feed()
    assert feed.tiers == TIERS
    consumer = Consumer(feed)
    for i, prompt in enumerate(PROMPTS):
        engine.generate([prompt], GREEDY)
        consumer.drain()
        engine.generate(FILLERS[3 * i : 3 * i + 3], GREEDY)
        consumer.drain()
    engine.offload.flush()  # the disk writes posted so far have run
    consumer.drain()
    stats = engine.offload.stats()
    assert stats.stored > POOL and stats.disk.evicted > 0
    assert stats.host_hits + stats.disk_hits > 0
    assert_matches_tiers(engine, consumer, tmp_path)
    # every block the pool evicted moved to host memory (removed there, stored here; or gone
    # from there again within the same drain: a net removal), but for those it dropped while
    # every host slot waited for its disk write
    evicted = consumer.removed("device")
    host_seen = consumer.stored("host") | consumer.removed("host")
    assert len(evicted - host_seen) <= stats.dropped < len(evicted) // 4
    assert len(evicted & consumer.stored("host")) > len(evicted) // 2
    # each tier evicted: host memory forgot blocks (still on disk), the disk deleted files
    assert consumer.removed("host") and consumer.removed("disk")
    assert consumer.removed("host") - consumer.held["host"]
    # a snapshot says the same as the deltas did
    assert {t: set(feed.snapshot(t)) for t in TIERS} == consumer.held
    engine.close()


def test_a_restarted_engine_announces_its_disk_and_a_corrupt_file_leaves_it(llama_dir, tmp_path):
    engine = restart_setup(llama_dir, tmp_path)  # its scan has run: the feed starts after it
    files = prefix_files(tmp_path, engine.offload.tiers.disk.layout)
    consumer = Consumer(engine.kv_event_feed())
    assert consumer.held["host"] == set() and consumer.held["device"] == set()
    assert len(consumer.held["disk"]) == engine.offload.stats().disk.scanned >= 4
    hashes = [int(f.name[:16], 16) for f in files]
    assert set(hashes) <= consumer.held["disk"]
    data = bytearray(files[1].read_bytes())
    data[-100] ^= 0x40
    files[1].write_bytes(data)
    run_one(engine, "corrupt", PROMPTS[0], GREEDY)
    engine.offload.flush()
    consumer.drain()
    assert hashes[1] in consumer.removed("disk") and hashes[1] not in consumer.held["disk"]
    assert hashes[0] in consumer.held["disk"]  # loaded, and still on disk
    assert_matches_tiers(engine, consumer, tmp_path)
    engine.close()
