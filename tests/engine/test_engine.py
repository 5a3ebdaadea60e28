"""The engine against HF transformers on the same weights (float64, so greedy ties can't flip)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.shared.errors import ModelLoadError
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, run_staggered, step_outputs
from tests.oracle import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def assert_all_blocks_free(engine) -> None:
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and not (stats.running or stats.waiting)


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied", "qwen2-bias"])
def test_greedy_matches_hf(checkpoints, variant):
    model_dir = checkpoints[variant]
    prompts = random_prompts(8, seed=1)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    engine = make_engine(model_dir)
    assert engine.generate(prompts[:1], GREEDY) == expected[:1]
    assert run_staggered(engine, prompts, GREEDY) == expected
    assert_all_blocks_free(engine)


def test_preemption_keeps_outputs_identical(checkpoints):
    model_dir = checkpoints["llama-gqa"]
    prompts = random_prompts(8, seed=2, max_len=60)
    expected = hf_greedy(model_dir, prompts, 20)
    sampling = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(model_dir, num_kv_blocks=8, prefix_cache=False)
    assert run_staggered(engine, prompts, sampling) == expected
    assert engine.stats().preemptions > 0
    assert_all_blocks_free(engine)


def test_chunked_prefill_and_prefix_cache_match_hf(checkpoints):
    model_dir = checkpoints["qwen2-bias"]
    shared = random_prompts(1, seed=3, max_len=1)[0] * 0 + list(range(20, 60))  # 40 shared tokens
    prompts = [shared + p for p in random_prompts(4, seed=4, max_len=10)] + [shared[:33]]
    expected = hf_greedy(model_dir, prompts, 8)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # A 24-token budget forces every prompt through several chunks.
    engine = make_engine(model_dir, max_num_batched_tokens=24)
    assert engine.generate(prompts[:1], sampling) == expected[:1]
    assert run_staggered(engine, prompts[1:], sampling) == expected[1:]
    assert engine.stats().prefix_hits >= 2 * 4  # two full shared blocks per later prompt
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_reproducible(llama_dir):
    engine = make_engine(llama_dir, dtype="float32")
    prompts = random_prompts(4, seed=5)
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True)
        for s in (7, 7, 8, 9)
    ]
    first = engine.generate([prompts[0]] * 4, seeded)
    assert first[0] == first[1]
    assert first[0] != first[2] and first[2] != first[3]
    # the same request alone, or batched with others, samples the same tokens
    alone = engine.generate([prompts[0]], seeded[0])
    assert alone[0] == first[0]


def test_stop_tokens_and_max_tokens(llama_dir):
    engine = make_engine(llama_dir)
    prompt = random_prompts(1, seed=6)[0]
    free_run = engine.generate([prompt], GREEDY)[0]
    stop_at = free_run[5]
    engine.add_request(
        "s",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True),
    )
    outs = []
    while engine.has_unfinished():
        outs.extend(step_outputs(engine))
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == free_run[: free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"
    assert (
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
        == free_run[:3]
    )


def test_eos_stops_unless_ignored(llama_dir):
    engine = make_engine(llama_dir)
    prompt = random_prompts(1, seed=6)[0]
    free_run = engine.generate([prompt], GREEDY)[0]
    engine.scheduler.eos_token_ids = (free_run[2],)  # the stop check's EOS ids
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert stopped == free_run[: free_run.index(free_run[2]) + 1]
    assert engine.generate([prompt], GREEDY)[0] == free_run


def test_abort_frees_blocks(llama_dir):
    engine = make_engine(llama_dir)
    for i, p in enumerate(random_prompts(4, seed=7)):
        engine.add_request(f"a{i}", p, GREEDY)
    engine.step()
    engine.step()
    for i in range(4):
        engine.abort(f"a{i}")
    assert step_outputs(engine) == []  # aborted sequences say nothing more
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)


def test_rejects_prompts_beyond_context(llama_dir):
    engine = make_engine(llama_dir, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the context length 64"):
        engine.add_request("x", [5] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("y", [10**6], SamplingParams(max_tokens=5))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loader_errors_name_file_and_tensor(llama_dir, tmp_path):
    bad_arch = _copy(llama_dir, tmp_path / "arch")
    cfg = json.loads((bad_arch / "config.json").read_text())
    (bad_arch / "config.json").write_text(
        json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture.*gpt2"):
        make_engine(bad_arch)

    from safetensors.torch import load_file, save_file

    missing = _copy(llama_dir, tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
    ):
        make_engine(missing)

    wrong = _copy(llama_dir, tmp_path / "wrong")
    tensors = load_file(wrong / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors[
        "model.layers.0.self_attn.o_proj.weight"
    ][:, :8].contiguous()
    save_file(tensors, wrong / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: shape mismatch for model\.layers\.0\.self_attn\.o_proj\.weight",
    ):
        make_engine(wrong)


def test_sharded_checkpoint_loads(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(llama_dir / f, sharded / f)
    tensors = load_file(llama_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (
        ("model-00001-of-00002.safetensors", names[:half]),
        ("model-00002-of-00002.safetensors", names[half:]),
    ):
        save_file({n: tensors[n] for n in part}, sharded / shard)
        weight_map |= dict.fromkeys(part, shard)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    prompt = random_prompts(1, seed=8)
    assert make_engine(sharded).generate(prompt, GREEDY) == make_engine(llama_dir).generate(
        prompt, GREEDY
    )
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match="model-00002-of-00002.safetensors: shard file not found"
    ):
        make_engine(sharded)


def test_demo_model_is_deterministic(tmp_path, monkeypatch):
    from pdserve.shared.models.demo import write_demo_model

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_demo_model(a)
    write_demo_model(b)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
