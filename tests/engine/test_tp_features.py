"""Quantization and speculative decoding at TP 2 (rank 1 a real process, gloo on CPU), each
against the same feature at TP 1: INT8 weights (rounded per rank on its slice, so as close as
test_quant_engine asks of INT8 against float), INT8 and FP8 KV caches (token for token, forks
copying quantized blocks on rank 1 too), n-gram and draft-model speculation (token for token,
greedy and seeded, log-probs within 1e-6). The engine's plain features at TP 2:
test_tp_engine.py, whose ``TPEngines`` keeps one TP engine alive at a time here too."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.kv.tp_layout import without_tp
from pdserve.shared.sampling import SamplingParams
from tests.engine.test_engine_lifecycle import all_free
from tests.engine.test_spec_draft import FIXED_K, draft_free, shrink
from tests.engine.test_spec_engine import GREEDY, NGRAM, repeating_prompts, run
from tests.engine.test_tp_engine import TPEngines
from tests.engine_support import make_engine, run_staggered

GQA = "llama-gqa"  # 2 KV heads: one on each rank


@pytest.fixture(scope="module")
def tp():
    engines = TPEngines()
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def draft_dir(checkpoints, tmp_path_factory) -> Path:
    """test_spec_draft's draft: the target's first 2 layers, perturbed (accepts about half)."""
    return shrink(checkpoints[GQA], tmp_path_factory.mktemp("tp-draft"), layers=2, noise=0.05)


def compare_runs(got, want) -> None:
    """Two ``test_spec_engine.run`` results: the same tokens, finish reasons and alternatives,
    log-probs within 1e-6."""
    assert got.tokens == want.tokens and got.reasons == want.reasons and got.top == want.top
    for key, values in want.logprobs.items():
        assert got.logprobs[key] == pytest.approx(values, abs=1e-6)


# ---- quantization -----------------------------------------------------------------------------


def test_int8_weights_stay_as_close_to_tp1_as_int8_to_float(checkpoints, tp):
    """test_quant_engine's prompts, float32, chunked prompts; every linear INT8 on both ranks,
    each rank's q/k/v and gate/up half as wide and o/down half as deep."""
    model_dir = checkpoints[GQA]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [[5, 17, 99, 3, 250, 11] * 5, [42] * 3]
    kw = dict(dtype="float32", max_num_batched_tokens=16, quantization="int8")
    base = make_engine(model_dir, **kw)
    want = base.generate(prompts, sp)
    engine = tp.get(model_dir, **kw)
    got = engine.generate(prompts, sp)
    assert [len(o) for o in got] == [6, 6]
    same = sum(a == b for o, r in zip(got, want, strict=True) for a, b in zip(o, r, strict=True))
    assert same >= 9  # test_quant_engine's bound: near-ties of random tiny weights may flip
    kinds = {type(m).__name__ for m in engine.runner.model.modules()}
    assert "CpuInt8Linear" in kinds and "Linear" not in kinds
    full, half = base.runner.model.layers[0], engine.runner.model.layers[0]
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj"):
        a, b = full.get_submodule(name), half.get_submodule(name)
        shape_full, shape_half = (a.out_features, a.in_features), (b.out_features, b.in_features)
        cut = 0 if name.endswith(("qkv_proj", "gate_up_proj")) else 1
        assert shape_half[cut] * 2 == shape_full[cut], name
        assert shape_half[1 - cut] == shape_full[1 - cut], name


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_gives_tp1_tokens(checkpoints, tp, kv):
    """float64, 16-token budget: later prompt chunks read the quantized cache back; n=3 forks
    copy a quantized block (values and scales as bytes) on rank 1 as on rank 0."""
    model_dir = checkpoints[GQA]
    prompts = repeating_prompts(3, seed=5)
    kw = dict(kv_cache_dtype=kv, max_num_batched_tokens=16)
    single = make_engine(model_dir, **kw)
    want = single.generate(prompts, GREEDY)
    engine = tp.get(model_dir, **kw)
    assert engine.kv_spec.quantized  # the blocks of both ranks: same format, half the heads
    assert without_tp(engine.layout_fingerprint()) == without_tp(single.layout_fingerprint())
    assert engine.bytes_per_block * 2 == single.bytes_per_block
    assert engine.generate(prompts, GREEDY) == want
    assert engine.generate_choices(prompts, replace(GREEDY, n=3)) == [[w] * 3 for w in want]
    assert all_free(engine)


# ---- speculative decoding ---------------------------------------------------------------------

SAMPLED = [
    replace(GREEDY, temperature=0.9, top_p=0.95, seed=11, logprobs=3),
    replace(GREEDY, logprobs=2, frequency_penalty=0.3),
    replace(GREEDY, temperature=1.0, seed=5, n=2),
]


def spec_runs(tp1: LLMEngine, tp2: LLMEngine) -> None:
    """Greedy with staggered arrivals: the tokens of TP 1 without speculation; seeded, penalised
    and forked requests with log-probs: TP 1's with the same speculation."""
    prompts = repeating_prompts(4, seed=1)
    plain = make_engine(tp1.model_dir, num_kv_blocks=256).generate(prompts, GREEDY)
    assert run_staggered(tp2, prompts, GREEDY) == plain
    counters = tp2.stats().spec
    assert counters.draft_tokens > counters.accepted_tokens > 0
    sampled = repeating_prompts(3, seed=4)
    compare_runs(run(tp2, sampled, SAMPLED), run(tp1, sampled, SAMPLED))
    assert all_free(tp2)


def test_ngram_speculation_matches_tp1(checkpoints, tp):
    model_dir = checkpoints[GQA]
    spec_runs(
        make_engine(model_dir, num_kv_blocks=256, **NGRAM),
        tp.get(model_dir, num_kv_blocks=256, **NGRAM),
    )


def test_draft_model_speculation_matches_tp1(checkpoints, tp, draft_dir):
    """The draft runs whole on rank 0 beside its sharded target: its own cache, its own pass."""
    model_dir = checkpoints[GQA]
    kw = dict(num_kv_blocks=256, draft_model=str(draft_dir), **FIXED_K)
    engine = tp.get(model_dir, **kw)
    spec_runs(make_engine(model_dir, **kw), engine)
    assert draft_free(engine)
