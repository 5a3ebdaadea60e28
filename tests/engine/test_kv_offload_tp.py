"""KV offload tiers at tensor parallelism 2 (issue 33): rank 1 is a real process (gloo on CPU)
holding its own shard of every host slot, and a disk file holds both ranks' shards. With a pool
far below the working set, the blocks evicted go down the tiers and come back as prefix hits,
and the tokens are TP 1's without tiers; an engine started again at TP 2 serves a known prefix
from the disk the first one left; TP 1 never reads those files (its layout differs).

Rank 1's part is checked through the tokens: a shard it failed to store, load or hand over
would be other KV for half of the heads. Only one TP engine may live in a process at a time:
each is closed before the next starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.services.engine.kv_tiers.block_file import HEADER, file_name
from pdserve.shared.kv.layout import prefix_block_hashes
from tests.engine.test_kv_offload import (
    FILLERS,
    GREEDY,
    POOL,
    PREFIXES,
    PROMPTS,
    SAMPLINGS,
    baseline,
    block_gib,
    run_one,
    tiers,
    workload,
)
from tests.engine_support import make_engine


def tp2(llama_dir: Path, **options):
    return make_engine(llama_dir, num_kv_blocks=POOL, tensor_parallel_size=2, **options)


@pytest.mark.parametrize(
    ("sampling", "disk"), [("greedy", True), ("seeded", False)], ids=["greedy-disk", "seeded-host"]
)
def test_tp2_tiers_serve_evicted_prefixes_as_tp1_does(llama_dir, tmp_path, sampling, disk):
    expected, _ = baseline(llama_dir, sampling)
    one = block_gib(llama_dir)  # a whole block (both ranks' shards)
    options = {"kv_offload_ram_gib": one * (8 if disk else 200)}
    if disk:
        options["kv_offload_disk"] = str(tmp_path)
    engine = tp2(llama_dir, **options)
    try:
        assert engine.offload.tiers.host.num_slots == (8 if disk else 200)
        assert workload(engine, SAMPLINGS[sampling]) == expected
        stats = tiers(engine)
        assert stats.stored > POOL and stats.load_failures == 0
        if disk:
            assert stats.disk_hits > 0 and stats.disk.loaded == stats.disk_hits
            # a file holds both ranks' shards: the whole block's bytes
            files = list(tmp_path.glob("*.kv"))
            assert len(files) == stats.disk_blocks > 8
            whole = 2 * engine.bytes_per_block
            assert {f.stat().st_size for f in files} == {HEADER.size + whole}
        else:
            assert stats.host_hits > 0 and stats.disk_hits == 0
    finally:
        engine.close()


def test_a_tp2_engine_started_again_serves_a_known_prefix_from_disk(llama_dir, tmp_path):
    expected = baseline(llama_dir)[0][0]
    options = {"kv_offload_ram_gib": 8 * block_gib(llama_dir), "kv_offload_disk": str(tmp_path)}
    first = tp2(llama_dir, **options)
    try:
        first.generate([PROMPTS[0]], GREEDY)
        first.generate(FILLERS[:6], GREEDY)  # PROMPTS[0]'s prefix goes down to disk
    finally:
        first.close()
    again = tp2(llama_dir, **options)
    try:
        again.offload.flush()  # the start-up scan
        layout = again.offload.tiers.disk.layout
        tokens, hit = run_one(again, "again", PROMPTS[0], GREEDY)
        assert tokens == expected
        assert hit == 64  # the prefix, loaded from disk into both ranks, not recomputed
        stats = tiers(again)
        assert stats.disk_hits == stats.disk.loaded == 4 and stats.host_hits == 0
    finally:
        again.close()
    names = {file_name(h, layout) for h in prefix_block_hashes(PREFIXES[0], 16)}
    assert names <= {f.name for f in tmp_path.glob("*.kv")}
    # TP 1 lays a block out otherwise: it ignores these files and computes the prefix
    tp1 = make_engine(llama_dir, num_kv_blocks=POOL, **options)
    try:
        tp1.offload.flush()  # the start-up scan
        stats = tiers(tp1)
        assert stats.disk_blocks == 0
        assert stats.disk.foreign_ignored == len(list(tmp_path.glob("*.kv"))) >= 4
        tokens, hit = run_one(tp1, "tp1", PROMPTS[0], GREEDY)
        assert tokens == expected and hit == 0
    finally:
        tp1.close()
