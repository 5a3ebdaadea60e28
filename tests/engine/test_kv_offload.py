"""KV offload tiers on a real engine (issue 33): with a pool far smaller than the working set, the
blocks it evicts go to host memory and disk and come back as prefix hits, and the tokens are
the ones a run without tiers gives, greedy and seeded; a restarted engine serves a prefix from
the disk another one left; a corrupted file is removed and never served; another layout's files
are ignored; a disk load lets other sequences step and survives an abort. Preemption, forks,
speculation and quantized caches with tiers on are tests/engine/test_kv_offload_features.py."""

from __future__ import annotations

import threading
from functools import cache
from pathlib import Path

import pytest
import torch

from pdserve.services.engine.sequence import SequenceStatus
from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, step_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
SAMPLINGS = {"greedy": GREEDY, "seeded": SEEDED}
POOL = 12  # blocks of 16 tokens: far below the working set below
# two 64-token prefixes (4 blocks each), three prompts on each, taken in turns
PREFIXES = [list(range(20, 84)), list(range(100, 164))]
PROMPTS = [PREFIXES[i % 2] + p for i, p in enumerate(random_prompts(6, seed=4, max_len=20))]
FILLERS = random_prompts(18, seed=9, max_len=60)  # between prompts: they evict the prefixes


def workload(engine, sampling: SamplingParams) -> list[list[int]]:
    """Each prompt, then three fillers that push its blocks out of the pool."""
    outputs = []
    for i, prompt in enumerate(PROMPTS):
        outputs += engine.generate([prompt], sampling)
        engine.generate(FILLERS[3 * i : 3 * i + 3], sampling)
    return outputs


def working_set_blocks() -> int:
    return sum(-(-(len(p) + 8) // 16) for p in PROMPTS + FILLERS)


@cache
def baseline(model_dir: Path, sampling: str = "greedy") -> tuple[list[list[int]], int]:
    """Tokens and prefix hits without tiers."""
    engine = make_engine(model_dir, num_kv_blocks=POOL)
    return workload(engine, SAMPLINGS[sampling]), engine.stats().prefix_hits


def tiers(engine):
    engine.offload.flush()
    return engine.offload.stats()


def ram_blocks(engine, n: int) -> float:
    """--kv-offload-ram-gib for ``n`` of this engine's blocks."""
    return n * engine.bytes_per_block / (1 << 30)


def block_gib(llama_dir: Path) -> float:
    return ram_blocks(make_engine(llama_dir, num_kv_blocks=4), 1)


def run_one(engine, bus_id: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], int]:
    """A request's tokens and the prompt tokens its first output says came from a cache."""
    engine.add_request(bus_id, prompt, sp)
    tokens, hit = [], None
    while engine.has_unfinished():
        for out in step_outputs(engine):
            tokens += out.new_token_ids
            hit = out.num_prefix_hit_tokens if hit is None else hit
    return tokens, hit


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("disk", [False, True], ids=["host", "host+disk"])
def test_tiers_serve_evicted_prefixes_with_identical_outputs(llama_dir, tmp_path, sampling, disk):
    assert working_set_blocks() >= 4 * POOL
    expected, hits_without = baseline(llama_dir, sampling)
    one = block_gib(llama_dir)
    # host memory alone holds the working set; with a disk, only a few blocks fit in memory
    options = {"kv_offload_ram_gib": one * (8 if disk else 200)}
    if disk:
        options["kv_offload_disk"] = str(tmp_path / "kv")
    engine = make_engine(llama_dir, num_kv_blocks=POOL, **options)
    assert workload(engine, SAMPLINGS[sampling]) == expected
    stats = tiers(engine)
    assert stats.stored > POOL  # the pool evicted cached blocks, and they went down a tier
    assert stats.load_failures == 0 and stats.disk.corrupt_removed == 0
    if disk:
        assert stats.disk_hits > 0 and stats.disk.loaded == stats.disk_hits
        assert stats.disk.written == stats.disk_blocks > 8
    else:
        assert stats.host_hits > 0 and stats.disk_hits == 0
    # what the tiers served counts as prefix hits, beyond what the pool alone kept
    assert engine.stats().prefix_hits >= hits_without + stats.host_hits + stats.disk_hits
    engine.close()


def restart_setup(llama_dir: Path, directory: Path, **options):
    """An engine that served PROMPTS[0] and let its prefix go down to disk, then closed."""
    one = block_gib(llama_dir)
    first = make_engine(
        llama_dir,
        num_kv_blocks=POOL,
        kv_offload_ram_gib=8 * one,
        kv_offload_disk=str(directory),
        **options,
    )
    first.generate([PROMPTS[0]], GREEDY)
    first.generate(FILLERS[:6], GREEDY)
    first.close()
    again = make_engine(
        llama_dir,
        num_kv_blocks=POOL,
        kv_offload_ram_gib=8 * one,
        kv_offload_disk=str(directory),
        **options,
    )
    again.offload.flush()  # the start-up scan
    return again


def prefix_files(directory: Path, layout: str) -> list[Path]:
    """The files of PROMPTS[0]'s prefix blocks, in order."""
    from pdserve.services.engine.kv_tiers.block_file import file_name
    from pdserve.shared.kv.layout import prefix_block_hashes

    return [directory / file_name(h, layout) for h in prefix_block_hashes(PREFIXES[0], 16)]


def test_a_restarted_engine_serves_a_known_prefix_from_disk(llama_dir, tmp_path):
    expected = baseline(llama_dir)[0][0]
    engine = restart_setup(llama_dir, tmp_path)
    scanned = tiers(engine).disk.scanned
    assert scanned >= 4
    tokens, hit = run_one(engine, "again", PROMPTS[0], GREEDY)
    assert tokens == expected
    assert hit == 64  # usage's cached_tokens: the prefix, loaded from disk, not recomputed
    stats = tiers(engine)
    assert stats.disk_hits == stats.disk.loaded == 4 and stats.host_hits == 0
    engine.close()


def test_a_corrupted_file_is_removed_counted_and_never_served(llama_dir, tmp_path):
    expected = baseline(llama_dir)[0][0]
    engine = restart_setup(llama_dir, tmp_path)
    files = prefix_files(tmp_path, engine.offload.tiers.disk.layout)
    assert all(f.exists() for f in files)
    data = bytearray(files[1].read_bytes())
    data[-100] ^= 0x40  # one bit of the second block's KV: only the checksum can tell
    files[1].write_bytes(data)
    tokens, hit = run_one(engine, "corrupt", PROMPTS[0], GREEDY)
    assert tokens == expected  # computed instead
    stats = tiers(engine)
    assert stats.disk.corrupt_removed == 1 and stats.load_failures == 1
    assert not files[1].exists() and files[0].exists()
    assert hit == 16  # computed again after the failed load: only the block before it loads
    engine.close()


def test_files_of_another_layout_are_ignored(llama_dir, tmp_path):
    """An int8 KV cache writes blocks of another layout into the same directory: a float
    engine never reads them as its own, nor deletes them."""
    int8 = restart_setup(llama_dir, tmp_path, kv_cache_dtype="int8")
    int8_layout = int8.offload.tiers.disk.layout
    int8.close()
    theirs = prefix_files(tmp_path, int8_layout)
    assert all(f.exists() for f in theirs)
    engine = make_engine(
        llama_dir,
        num_kv_blocks=POOL,
        kv_offload_disk=str(tmp_path),
        kv_offload_ram_gib=8 * block_gib(llama_dir),
    )
    layout = engine.offload.tiers.disk.layout
    assert layout != int8_layout
    # and one under our name whose header says int8: a copy, or a file from an older build
    mine = prefix_files(tmp_path, layout)[0]
    mine.write_bytes(theirs[0].read_bytes())
    engine.close()
    engine = make_engine(
        llama_dir,
        num_kv_blocks=POOL,
        kv_offload_disk=str(tmp_path),
        kv_offload_ram_gib=8 * block_gib(llama_dir),
    )
    stats = tiers(engine)
    assert stats.disk.foreign_ignored == len(list(tmp_path.glob(f"*.{int8_layout}.kv"))) + 1
    assert stats.disk_blocks == 0
    tokens, hit = run_one(engine, "fresh", PROMPTS[0], GREEDY)
    assert tokens == baseline(llama_dir)[0][0] and hit == 0
    assert all(f.exists() for f in theirs) and mine.exists()
    engine.close()


def test_a_disk_load_lets_others_step_and_an_abort_during_it_frees_its_blocks(llama_dir, tmp_path):
    engine = restart_setup(llama_dir, tmp_path)
    gate = threading.Event()
    engine.offload.tiers.disk._jobs.put(gate.wait)  # the disk thread is busy until the gate
    fresh = random_prompts(1, seed=99, max_len=30)[0]  # nothing of it on disk
    engine.add_request("other", fresh, SamplingParams(max_tokens=20, ignore_eos=True))
    step_outputs(engine)  # its prefill
    engine.add_request("loading", PROMPTS[0], GREEDY)
    others = 0
    for _ in range(5):  # the load cannot finish: the other sequence decodes meanwhile
        others += sum(len(o.new_token_ids) for o in step_outputs(engine))
    seq = engine.scheduler.seqs["loading"]
    assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV and others == 5
    engine.abort("loading")
    step_outputs(engine)
    assert "loading" in engine.scheduler.seqs  # its blocks are being written: it waits
    gate.set()
    engine.offload.flush()
    while engine.has_unfinished():
        assert all(o.bus_id == "other" for o in step_outputs(engine))
    assert "loading" not in engine.scheduler.seqs
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and not stats.pulling
    engine.close()


def test_refusals_at_start(llama_dir, tmp_path):
    with pytest.raises(StartupError, match="through host memory"):
        make_engine(llama_dir, kv_offload_disk=str(tmp_path))
    with pytest.raises(StartupError, match="prefix cache"):
        make_engine(llama_dir, kv_offload_ram_gib=0.01, prefix_cache=False)
    with pytest.raises(StartupError, match="holds no KV block"):
        make_engine(llama_dir, kv_offload_ram_gib=1e-9)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_come_back_byte_for_byte(llama_dir, tmp_path, device):
    """A prefix's blocks as the pool computed them are the bytes host memory and disk hold once
    it evicted them, and the bytes loaded back into new pool blocks: on CUDA too, where the
    copies are queued without waiting (pinned memory) and only ``settle`` waits for them."""
    from pdserve.services.engine.kv_tiers import HOST
    from pdserve.services.engine.kv_tiers.block_file import read_block
    from pdserve.shared.kv.layout import prefix_block_hashes

    one = block_gib(llama_dir)
    engine = make_engine(
        llama_dir,
        device=device,
        dtype="float32",
        num_kv_blocks=POOL,
        kv_offload_ram_gib=6 * one,
        kv_offload_disk=str(tmp_path),
    )
    bm, raw, tiers_ = engine.block_manager, engine.offload.raw, engine.offload.tiers
    first = engine.generate([PROMPTS[0]], GREEDY)
    hashes = prefix_block_hashes(PREFIXES[0], 16)
    computed = raw[[bm.hash_to_block[h] for h in hashes]].cpu()
    for i in range(0, 18, 3):
        engine.generate(FILLERS[i : i + 3], GREEDY)
    engine.offload.flush()
    assert not any(h in bm.hash_to_block for h in hashes)  # all four evicted
    for h, want in zip(hashes, computed, strict=True):
        on_disk = read_block(tiers_.disk.path(h), tiers_.disk.layout, h, engine.bytes_per_block)
        assert torch.equal(torch.from_numpy(on_disk.copy()), want)
        if tiers_.where(h) == HOST:
            assert torch.equal(tiers_.host.slab[tiers_.host.index[h]], want)
    tokens, hit = run_one(engine, "back", PROMPTS[0], GREEDY)
    assert hit == 64 and tokens == first[0]
    assert torch.equal(raw[[bm.hash_to_block[h] for h in hashes]].cpu(), computed)
    engine.close()
