"""Multi-LoRA in the engine: two PEFT adapters and the base model in one batch, token for token
what HF + PEFT generates for each; prefix-cache isolation between adapters; lazy loading with
least-recently-used eviction; the start-up refusals."""

from __future__ import annotations

import pytest

from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, step_outputs
from tests.lora_support import build_adapter, peft_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    """Two adapters of the llama-gqa checkpoint: every projection at rank 8, and a rank-4
    rsLoRA one on a subset (so ranks are padded and untouched projections stay base)."""
    base = checkpoints["llama-gqa"]
    root = tmp_path_factory.mktemp("lora")
    a = build_adapter(base, root / "a", seed=1, rank=8)
    b = build_adapter(
        base,
        root / "b",
        seed=2,
        rank=4,
        alpha=8.0,
        targets=("q_proj", "v_proj", "down_proj"),
        rslora=True,
    )
    return base, {"a": a, "b": b}


def lora_engine(base, paths, **overrides):
    modules = [f"{name}={path}" for name, path in paths.items()]
    return make_engine(base, lora_modules=modules, **overrides)


def run_all(engine, requests: list[tuple[list[int], str | None]], sp=GREEDY) -> list[list[int]]:
    """Every request added before the first step: they share the batch from the start."""
    out: dict[str, list[int]] = {}
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, sp, lora=lora)
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for o in step_outputs(engine):
            out[o.bus_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(requests))]


def test_mixed_batch_matches_hf_peft(adapters):
    base, paths = adapters
    prompts = random_prompts(6, seed=5)
    loras = ["a", None, "b", "a", "b", None]
    expected = [
        peft_greedy(base, paths[name] if name else None, [p], GREEDY.max_tokens)[0]
        for p, name in zip(prompts, loras, strict=True)
    ]
    # the adapters do change the output (else this test would prove nothing)
    assert expected[0] != peft_greedy(base, None, prompts[:1], GREEDY.max_tokens)[0]
    engine = lora_engine(base, paths)
    assert run_all(engine, list(zip(prompts, loras, strict=True))) == expected
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks


def test_prefix_cache_never_crosses_adapters(adapters):
    base, paths = adapters
    prompt = random_prompts(1, seed=7, max_len=1)[0] + list(range(10, 50))  # > 2 blocks
    engine = lora_engine(base, paths)
    hits = {}
    for i, lora in enumerate(["a", "b", None, "a"]):
        engine.add_request(f"q{i}", prompt, GREEDY, lora=lora)
        while engine.has_unfinished():
            for o in step_outputs(engine):
                if o.finish_reason is not None:
                    hits[i] = o.num_prefix_hit_tokens
    assert hits[0] == hits[1] == hits[2] == 0  # a, then b, then the base: nothing shared
    assert hits[3] >= 32  # a again: its own blocks


def test_lazy_loading_evicts_least_recently_used(adapters):
    base, paths = adapters
    prompts = random_prompts(3, seed=9)
    expected = [
        peft_greedy(base, paths[name], [p], GREEDY.max_tokens)[0]
        for p, name in zip(prompts, ["a", "b", "a"], strict=True)
    ]
    engine = lora_engine(base, paths, max_loras=1)
    assert engine.lora.resident == []
    # a and b at once with one slot: b waits for a's sequence to end, then takes the slot
    got = run_all(engine, [(prompts[0], "a"), (prompts[1], "b"), (prompts[2], "a")])
    assert got == expected
    assert engine.lora.loads == 3 and engine.lora.resident == ["a"]


def test_unknown_adapter_and_rank_refused(adapters):
    base, paths = adapters
    engine = lora_engine(base, paths)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora="nope")
    with pytest.raises(StartupError, match="max-lora-rank"):
        lora_engine(base, paths, max_lora_rank=4)
    with pytest.raises(StartupError, match="NAME=PATH"):
        make_engine(base, lora_modules=["just-a-path"])


def test_compiled_decode_step_serves_adapters(adapters):
    """The compiled decode step takes each row's slot: the same tokens, and no compilation
    after start whichever adapters a step mixes. Three rows pad to a bucket of 4, whose padding
    row rewrites row 0's K/V: under row 0's adapter, or the KV would be the base model's."""
    base, paths = adapters
    prompts = random_prompts(3, seed=11)
    loras = ["b", None, "a"]
    engine = lora_engine(base, paths, enforce_eager=False, dtype="float32")
    eager = lora_engine(base, paths, dtype="float32")
    requests = list(zip(prompts, loras, strict=True))
    assert run_all(engine, requests) == run_all(eager, requests)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.steps > 2 and graphs.recompiles == 0
