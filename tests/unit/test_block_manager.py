from __future__ import annotations

import subprocess
import sys

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.kv.layout import prefix_block_hashes
from pdserve.shared.sampling import SamplingParams


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), 0, 0.0)


def match_prefix(bm: BlockManager, s: Sequence) -> int:
    """Look the cached prefix up and attach it at once, as admission does once it fits."""
    return bm.attach_prefix(s, bm.find_prefix(s))


def computed(bm: BlockManager, s: Sequence, n: int | None = None) -> Sequence:
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens if n is None else n
    bm.commit(s)
    return s


def test_hashes_are_stable_across_processes():
    tokens = list(range(100))
    here = prefix_block_hashes(tokens, 16)
    code = "from pdserve.shared.kv.layout import prefix_block_hashes as h; print(h(list(range(100)), 16))"
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert str(here) == there.strip()
    assert len(here) == 6  # only full blocks
    # chained: the same block content under a different parent hashes differently
    assert prefix_block_hashes(tokens[16:32], 16)[0] != here[1]


def test_prefix_reuse_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, seq("a", list(range(10))))  # blocks: 2 full + 1 partial
    b = seq("b", list(range(8)) + [99, 98, 97])
    assert match_prefix(bm, b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8 - 2  # b still holds the shared prefix
    bm.free_sequence(b)
    assert bm.num_free_blocks == 8


def test_match_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, seq("a", list(range(8))))
    again = seq("b", list(range(8)))
    # all 8 tokens are cached, but the last one must run to produce logits: only 1 block reused
    assert match_prefix(bm, again) == 4


def test_partial_blocks_are_never_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, seq("a", list(range(6))))
    assert match_prefix(bm, seq("b", list(range(6)) + [7])) == 4


def test_lru_eviction_only_when_space_is_needed():
    bm = BlockManager(num_blocks=6, block_size=4)
    old = computed(bm, seq("old", list(range(9))))
    new = computed(bm, seq("new", list(range(100, 109))))
    bm.free_sequence(old)
    bm.free_sequence(new)
    assert len(bm.hash_to_block) == 4
    # two blocks: old's uncached partial tail, then its least recently freed cached block
    fresh = seq("fresh", [1000] * 5)
    bm.allocate(fresh, 5)
    assert len(bm.hash_to_block) == 3
    assert match_prefix(bm, seq("probe_old", list(range(9)))) == 4  # old's first block survived
    bm.free_sequence(fresh)


def test_a_block_taken_again_gets_a_higher_generation():
    """What a lease's epoch is checked against (lease.py): a block's generation rises exactly
    when it is taken off the free list to be written, never when a cached prefix is reused."""
    bm = BlockManager(num_blocks=4, block_size=4)
    assert not bm.generations.any()
    a = computed(bm, seq("a", list(range(8))))  # two full blocks, cached once freed
    first = bm.generations[a.block_table].copy()
    assert sorted(first) == [1, 2]
    bm.free_sequence(a)
    again = seq("a2", list(range(9)))
    assert match_prefix(bm, again) == 8  # the cached blocks themselves: KV unchanged
    assert list(bm.generations[again.block_table]) == list(first)
    bm.free_sequence(again)
    other = computed(bm, seq("b", list(range(100, 116))))  # all four blocks: evicts a's
    assert bm.generations[other.block_table].min() > first.max()


def test_eviction_under_pressure_keeps_outputs_consistent():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = computed(bm, seq("a", list(range(9))))
    bm.free_sequence(a)
    b = seq("b", list(range(50, 62)))
    bm.allocate(b, 12)  # needs every block: all of a's cached blocks are evicted
    assert bm.hash_to_block == {}
    assert match_prefix(bm, seq("c", list(range(9)))) == 0


def test_disabled_cache_never_matches():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    computed(bm, seq("a", list(range(12))))
    assert match_prefix(bm, seq("b", list(range(12)))) == 0
    assert bm.hash_to_block == {}


def test_cache_events_report_stores_and_evictions():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = computed(bm, seq("a", list(range(8))))
    stored, removed = bm.drain_events()
    assert stored == prefix_block_hashes(list(range(8)), 4) and removed == []
    bm.free_sequence(a)
    b = seq("b", list(range(50, 58)))
    bm.allocate(b, 8)
    stored, removed = bm.drain_events()
    assert stored == [] and sorted(removed) == sorted(prefix_block_hashes(list(range(8)), 4))
    assert bm.drain_events() == ([], [])


def test_cache_events_are_net_changes_per_interval():
    bm = BlockManager(num_blocks=1, block_size=4)
    first = prefix_block_hashes([1, 2, 3, 4], 4)[0]
    a = computed(bm, seq("a", [1, 2, 3, 4]))
    bm.free_sequence(a)
    b = computed(bm, seq("b", [5, 6, 7, 8]))  # evicts a's block within the same interval
    second = prefix_block_hashes([5, 6, 7, 8], 4)[0]
    # a's block came and went: only its removal is reported, so the order of applying the two
    # lists cannot resurrect it on the receiving side
    assert bm.drain_events() == ([second], [first])
    bm.free_sequence(b)
    computed(bm, seq("c", [1, 2, 3, 4]))  # evict b's, store a's hash again
    assert bm.drain_events() == ([first], [second])


def test_undrained_events_stay_bounded():
    bm = BlockManager(num_blocks=2, block_size=4)
    for i in range(5000):  # an engine nobody drains: every block stored, then evicted
        s = computed(bm, seq(f"s{i}", [i, i, i, i]))
        bm.free_sequence(s)
    assert len(bm.stored_events) + len(bm.removed_events) <= 4 * 2 + 1024
    stored, removed = bm.drain_events()
    assert set(stored) == set(bm.hash_to_block) and not set(removed) & set(bm.hash_to_block)


def child_of(parent: Sequence, index: int) -> Sequence:
    return Sequence(parent.bus_id, parent.token_ids, SamplingParams(), 0, 0.0, index=index)


def test_fork_shares_full_blocks_and_copies_the_one_of_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, seq("r", list(range(10))))  # blocks: 2 full + the last token's
    kids = [child_of(parent, i) for i in (1, 2)]
    copies = [bm.fork(parent, kid, 10) for kid in kids]
    assert [src for src, _ in copies] == [parent.block_table[2]] * 2
    assert [kid.block_table for kid in kids] == [
        parent.block_table[:2] + [dst] for _, dst in copies
    ]
    assert [bm.ref_counts[b] for b in parent.block_table] == [3, 3, 1]
    assert all(bm.ref_counts[dst] == 1 for _, dst in copies)
    # the children inherit the shared blocks' hashes, under their own seq ids
    assert bm.seq_hashes["r#1"] == bm.seq_hashes["r#2"] == bm.seq_hashes["r"][:2]
    # a full last block is copied too: the child rewrites its last slot
    whole = computed(bm, seq("w", list(range(100, 108))))
    src, dst = bm.fork(whole, child_of(whole, 1), 8)
    assert src == whole.block_table[1] and bm.ref_counts[whole.block_table[0]] == 2
    assert dst not in whole.block_table
    for s in [parent, *kids]:
        bm.free_sequence(s)
    assert bm.num_free_blocks == 8 - 3 and bm.ref_counts.count(0) == 8 - 3


def test_fork_without_a_free_block_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    parent = computed(bm, seq("r", list(range(12))))
    kid = child_of(parent, 1)
    assert bm.fork(parent, kid, 12) is None
    assert kid.block_table == [] and bm.ref_counts == [1, 1, 1] and "r#1" not in bm.seq_hashes
    bm.free_sequence(parent)
    assert bm.num_free_blocks == 3


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_in_use():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, seq("a", list(range(10))))  # 2 full blocks cached
    assert bm.reset_prefix_cache() is None  # a holds them: nothing changes
    assert len(bm.hash_to_block) == 2 and not bm.cleared
    bm.free_sequence(a)
    bm.drain_events()
    assert bm.reset_prefix_cache() == (2, 0)  # no tiers: none of theirs
    assert bm.cleared and bm.hash_to_block == {} and bm.drain_events() == ([], [])
    again = seq("b", list(range(10)))
    assert match_prefix(bm, again) == 0  # computed anew
    assert bm.num_free_blocks == 8  # every block still free, now holding nothing
