"""Multi-LoRA at TP 2 (rank 1 a real process, gloo on CPU): each adapter cut like its base
layers (B by output columns on q/k/v and gate/up, A by input channels on o and down, the
latter's product summed by the layer's one all-reduce). Two adapters and the base model in one
batch generate token for token what HF + PEFT does; adapters loaded at run time, and a slot
reused after an eviction, are cut and loaded on rank 1 too."""

from __future__ import annotations

import pytest

from pdserve.services.engine.engine import LLMEngine
from tests.engine.test_lora_engine import GREEDY, adapters, run_all
from tests.engine.test_lora_runtime import answer
from tests.engine_support import make_engine, random_prompts
from tests.lora_support import peft_greedy

__all__ = ["adapters"]  # the module fixture, shared with test_lora_engine


@pytest.fixture
def tp_engine():
    """One TP engine at a time (each holds a process group and a rank process)."""
    made: list[LLMEngine] = []

    def start(base, **options) -> LLMEngine:
        engine = make_engine(base, tensor_parallel_size=2, **options)
        made.append(engine)
        return engine

    yield start
    for engine in made:
        engine.close()


def test_tp2_mixed_batch_matches_hf_peft(adapters, tp_engine):
    base, paths = adapters
    prompts = random_prompts(6, seed=5)
    loras = ["a", None, "b", "a", "b", None]
    expected = [
        peft_greedy(base, paths[name] if name else None, [p], GREEDY.max_tokens)[0]
        for p, name in zip(prompts, loras, strict=True)
    ]
    assert expected[0] != peft_greedy(base, None, prompts[:1], GREEDY.max_tokens)[0]
    modules = [f"{name}={path}" for name, path in paths.items()]
    engine = tp_engine(base, lora_modules=modules)
    assert engine.shard.size == 2
    assert run_all(engine, list(zip(prompts, loras, strict=True))) == expected
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks


def test_tp2_run_time_loads_and_slot_reuse(adapters, tp_engine):
    """Both adapters loaded at run time into one slot: a, then b (after a's sequence ends, in
    a's slot), then a again; every load reaches rank 1, or its half of the heads and channels
    would run the adapter that sat there before."""
    base, paths = adapters
    prompts = random_prompts(3, seed=9)
    names = ["a", "b", "a"]
    expected = [
        peft_greedy(base, paths[name], [p], GREEDY.max_tokens)[0]
        for p, name in zip(prompts, names, strict=True)
    ]
    engine = tp_engine(base, enable_lora=True, max_loras=1)
    for name in ("a", "b"):
        assert answer(engine, engine.load_lora(name, str(paths[name]))) is None
    assert run_all(engine, list(zip(prompts, names, strict=True))) == expected
    assert engine.lora is not None and engine.lora.loads == 3
