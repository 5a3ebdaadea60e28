"""The disk tier's files name the checkpoint, not only the layout (issue 33): another
checkpoint served under the same name and shape (a fine-tune, a re-conversion) shares the KV
layout fingerprint, so only the weights digest (kv_tiers/weights_digest.py) keeps it from
loading the first checkpoint's blocks as its own."""

from __future__ import annotations

import shutil
from pathlib import Path

from pdserve.services.engine.kv_tiers.weights_digest import weights_digest
from pdserve.shared.kv.layout import layout_id
from tests.checkpoints import build_checkpoint
from tests.engine.test_kv_offload import FILLERS, GREEDY, POOL, PROMPTS, block_gib, run_one, tiers
from tests.engine_support import make_engine

NAME = "tiny"  # both checkpoints are served under it


def disk_engine(model_dir: Path, directory: Path):
    return make_engine(
        model_dir,
        num_kv_blocks=POOL,
        served_model_name=NAME,
        kv_offload_ram_gib=8 * block_gib(model_dir),
        kv_offload_disk=str(directory),
    )


def test_the_digest_covers_every_byte_of_the_weights_and_the_config(llama_dir, tmp_path):
    copy = Path(shutil.copytree(llama_dir, tmp_path / "copy"))
    assert weights_digest(copy) == weights_digest(llama_dir)  # a copy is the same model
    assert weights_digest(copy, "int8") != weights_digest(copy)  # quantized at load: other KV
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 + 3] ^= 1  # one bit in the middle of a tensor: no sample would see it
    weights.write_bytes(data)
    assert weights_digest(copy) != weights_digest(llama_dir)
    shutil.copy(llama_dir / "model.safetensors", weights)
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"rope_theta"', '"rope_theta_x"'))
    assert weights_digest(copy) != weights_digest(llama_dir)


def test_another_checkpoint_of_the_same_name_and_shape_never_loads_the_first_ones_blocks(
    llama_dir, tmp_path
):
    other = build_checkpoint("llama-gqa", tmp_path / "other" / llama_dir.name, seed=1)
    kv = tmp_path / "kv"
    # the second checkpoint's own answer, without tiers
    own = make_engine(other, num_kv_blocks=POOL, served_model_name=NAME)
    expected = own.generate([PROMPTS[0]], GREEDY)[0]
    own.close()
    first = disk_engine(llama_dir, kv)
    first_tokens = first.generate([PROMPTS[0]], GREEDY)[0]
    first.generate(FILLERS[:6], GREEDY)  # its prefix goes down to disk
    first_id = first.offload.tiers.disk.layout
    first.close()
    assert first_tokens != expected  # the weights differ where it shows

    second = disk_engine(other, kv)
    disk = second.offload.tiers.disk
    # same name and shape: one KV layout, told apart by the weights digest alone
    assert layout_id(second.layout_fingerprint()) == disk.base_layout == first_id[:16]
    assert disk.layout != first_id
    stats = tiers(second)
    assert stats.disk.scanned == 0 and stats.disk_blocks == 0
    assert stats.disk.other_weights_ignored == len(list(kv.glob(f"*.{first_id}.kv"))) >= 4
    assert stats.disk.foreign_ignored == 0
    tokens, hit = run_one(second, "other", PROMPTS[0], GREEDY)
    assert (tokens, hit) == (expected, 0)  # computed, not the first checkpoint's KV
    assert tiers(second).disk_hits == 0
    second.close()

    # the first checkpoint's files were left alone: it still finds its own prefix after both
    again = disk_engine(llama_dir, kv)
    assert tiers(again).disk.other_weights_ignored == 0  # (the scan ran: nothing of the second's)
    tokens, hit = run_one(again, "again", PROMPTS[0], GREEDY)
    assert (tokens, hit) == (first_tokens, 64)
    assert tiers(again).disk_hits == 4
    again.close()
