"""The compiled decode step (services/engine/decode_graph.py) against the eager path and HF.

Each case runs the same requests through an eager engine and a compiled one, which must emit
identical tokens (float64, so a greedy tie cannot flip), and where HF can say, HF's too. The
mixes cross the graph's edges: batch 1, a bucket's edge, padded rows, sequences joining and
leaving, prefix-cache hits, chunked prefill beside decodes (those steps run eagerly), and
speculative verification rows (flattened into one graph row per query token). No case may
compile after start: a new batch size within the buckets, or a longer context, reuses the graphs.
"""

from __future__ import annotations

import pytest

from pdserve.kernels import cpu_gemv
from pdserve.services.engine.decode_graph import buckets_up_to
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, run_staggered
from tests.oracle import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def both(model_dir, **overrides):
    """An eager engine and a compiled one, otherwise alike."""
    eager = make_engine(model_dir, **overrides)
    compiled = make_engine(model_dir, enforce_eager=False, **overrides)
    assert eager.runner.graphs is None and compiled.runner.graphs is not None
    return eager, compiled


def served_compiled(engine) -> None:
    graphs = engine.runner.graphs
    assert graphs.compiled_at_start >= 1
    assert graphs.steps > 2, "no request's step ran compiled"
    assert graphs.recompiles == 0, "a step compiled after start"


def test_buckets():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert buckets_up_to(9) == [1, 2, 4, 8, 16]
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_staggered_batches_match_eager_and_hf(checkpoints, variant):
    """Requests join one per step and leave as they finish: batch sizes 1-9 cross the buckets
    1, 2, 4, 8 and 16 (9 rows padded to 16), and contexts cross block boundaries."""
    model_dir = checkpoints[variant]
    prompts = random_prompts(9, seed=11, max_len=30)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    eager, compiled = both(model_dir, max_num_seqs=16)
    assert compiled.generate(prompts[:1], GREEDY) == expected[:1]  # batch 1
    assert run_staggered(compiled, prompts, GREEDY) == expected
    assert run_staggered(eager, prompts, GREEDY) == expected
    served_compiled(compiled)


def test_prefix_hits_and_chunked_prefill_match_eager(checkpoints):
    """Shared prefixes (cache hits) and a small token budget (prompts in several chunks beside
    running decodes): the decode-only steps run compiled, the mixed ones eagerly."""
    model_dir = checkpoints["llama-gqa"]
    shared = list(range(20, 60))
    prompts = [shared + p for p in random_prompts(6, seed=12, max_len=12)]
    sampling = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    eager, compiled = both(model_dir, max_num_batched_tokens=24)
    assert run_staggered(compiled, prompts, sampling) == run_staggered(eager, prompts, sampling)
    assert compiled.stats().prefix_hits > 0
    served_compiled(compiled)


def test_speculative_verification_beside_compiled_decodes(checkpoints):
    """n-gram speculation: steps with verification rows run compiled too, each draft token a
    graph row whose context ends at itself, and accept what the eager path accepts. Drafts of
    different lengths beside plain decode rows cross the buckets (max_num_seqs 16: up to 16
    tokens a graph step)."""
    model_dir = checkpoints["llama-gqa"]
    prompts = [p * 3 for p in random_prompts(5, seed=13, max_len=8)]  # repeats: drafts found
    spec = {"speculative": "ngram", "ngram_min": 1, "spec_token_cost": 0.0, "max_num_seqs": 16}
    eager, compiled = both(model_dir, **spec)
    out = run_staggered(compiled, prompts, GREEDY)
    assert out == run_staggered(eager, prompts, GREEDY)
    assert out == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    served_compiled(compiled)
    graphs = compiled.runner.graphs
    assert graphs.verify_steps > 0, "no verification step ran compiled"
    assert compiled.stats().spec.accepted_tokens > 0


def test_sampled_requests_match_eager(checkpoints):
    """Seeded sampling reads the same logits on both paths."""
    model_dir = checkpoints["llama-gqa"]
    prompts = random_prompts(4, seed=14, max_len=20)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    eager, compiled = both(model_dir)
    assert run_staggered(compiled, prompts, sampling) == run_staggered(eager, prompts, sampling)
    served_compiled(compiled)


def test_quantized_cache_and_prefill_only_engines_stay_eager(checkpoints):
    model_dir = checkpoints["llama-gqa"]
    assert make_engine(model_dir, enforce_eager=False, kv_cache_dtype="int8").runner.graphs is None
    assert make_engine(model_dir, enforce_eager=False, prefill_only=True).runner.graphs is None


def test_cpu_linear_weights_are_column_major(checkpoints):
    """Batch-1 decode is a GEMV per layer, which reads a transposed-contiguous weight at the
    memory's speed (model_setup.lay_out_for_gemv); values and shapes stay as loaded."""
    engine = make_engine(checkpoints["llama-mha-tied"])
    model = engine.runner.model
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        weight = model.layers[0].get_submodule(name).weight
        assert weight.t().is_contiguous() and not weight.is_contiguous(), name
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied


def test_int8_weights_compile_and_match_eager(checkpoints):
    """The INT8 layers run inside the graph as one opaque op that picks the AVX2 kernel or
    fbgemm by row count at run time (quant/int8_linear.py): batches 1-5 cross its edge at 4."""
    model_dir = checkpoints["llama-gqa"]
    prompts = random_prompts(5, seed=15, max_len=20)
    eager, compiled = both(model_dir, dtype="float32", quantization="int8")
    # ... and the graph's attention reads the float32 pages through the C++ op
    assert compiled.runner.model.layers[0].self_attn._cpu_paged_attention == cpu_gemv.available()
    assert run_staggered(compiled, prompts, GREEDY) == run_staggered(eager, prompts, GREEDY)
    served_compiled(compiled)


def test_bf16_weights_take_the_gemv_kernel_and_match_eager(checkpoints):
    """bfloat16 linears on an AVX2 CPU go through kernels/cpu_gemv at 1-4 rows, F.linear
    above, in the graph and out of it alike: the same tokens, and no recompile."""
    model_dir = checkpoints["llama-gqa"]
    prompts = random_prompts(6, seed=17, max_len=20)
    eager, compiled = both(model_dir, dtype="bfloat16")
    if cpu_gemv.available():
        model = compiled.runner.model
        assert model.lm_head._bf16_gemv and model.layers[0].mlp.down_proj._bf16_gemv
        # batches 5 and 6 run the graph of bucket 8, its attention the C++ op over the pages
        assert model.layers[0].self_attn._cpu_paged_attention
    assert run_staggered(compiled, prompts, GREEDY) == run_staggered(eager, prompts, GREEDY)
    served_compiled(compiled)


def test_engines_in_one_process_keep_their_own_graphs(checkpoints):
    """Dynamo keeps compiled graphs per code object: each engine compiles its own, so a process
    that builds many (a test session did) never meets the recompile limit, and no engine runs
    another's graph (only tensor guards are kept)."""
    model_dir = checkpoints["llama-gqa"]
    prompts = random_prompts(2, seed=16, max_len=10)
    expected = make_engine(model_dir).generate(prompts, GREEDY)
    for _ in range(5):  # buckets [1, 2]: a recompile limit of 8 graphs, 10 made
        engine = make_engine(model_dir, enforce_eager=False, max_num_seqs=2)
        assert engine.runner.graphs.compiled_at_start == 2
        assert engine.generate(prompts, GREEDY) == expected
        served_compiled(engine)
