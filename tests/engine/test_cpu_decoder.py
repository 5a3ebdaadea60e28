"""The C++ decoder (kernels/cpu_decode.cpp, services/engine/cpu_decoder.py) against the compiled
graphs it stands in for, and against the eager path: steps of 1-4 rows in INT8, 1-8 in bfloat16
and 1-24 in float32 (their kernels read the weights once for them all)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_gemv
from pdserve.services.engine.outputs import StepInputs
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, run_staggered

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="the AVX2 kernels did not build")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(model_dir, **overrides):
    return make_engine(model_dir, **{"dtype": "float32", "enforce_eager": False, **overrides})


def _differ_only_at_near_ties(model_dir, prompts, got, expected, margin=0.02) -> None:
    """Where two greedy runs part, float32 HF's two best logits there are within ``margin``: a
    tie that bfloat16's rounding may break either way (8 bits of mantissa: 0.0078 at 2.0)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    for prompt, a, b in zip(prompts, got, expected, strict=True):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + b[:k]])).logits[0, -1]
        top = torch.topk(logits, 2).values
        assert {a[k], b[k]} <= set(torch.topk(logits, 3).indices.tolist())
        assert float(top[0] - top[1]) < margin, f"parted at {k} without a tie"


@pytest.mark.parametrize(
    ("variant", "dtype", "tol"),
    [
        ("llama-gqa", "float32", 1e-4),
        ("qwen2-bias", "float32", 1e-4),
        ("llama-gqa", "bfloat16", 3e-2),
    ],
)
@pytest.mark.parametrize("drafts", [2, 6])
def test_hidden_states_match_the_graphs_on_ragged_pages(checkpoints, variant, dtype, tol, drafts):
    """Rows whose contexts end inside a block, on a block's edge and past several blocks, over a
    cache of random K/V; a verification row (three query tokens, each its own context) beside
    them (with 6 drafts, 8 rows: float32's row groups past 4, bfloat16's 8 rows in a pass). The C++ decoder
    and the Inductor graph write the same K/V and read the same pages (bfloat16: the graph does
    not round where the eager model does, the decoder does)."""
    engine = _engine(checkpoints[variant], num_kv_blocks=32, dtype=dtype)
    graphs = engine.runner.graphs
    assert graphs.fused is not None
    torch.manual_seed(0)
    engine.runner.kv_cache.normal_()
    rows = 2 + drafts
    inputs = StepInputs(
        input_ids=list(range(11, 11 + rows)),
        counts=[1, 1 + drafts],
        starts=[16, 37],  # the first row's new token opens block 1; the second's span 2-3 and on
        block_tables=[[5, 9], [2, 7, 30]],
        num_decodes=1,
        num_verifies=1,
        read=list(range(rows)),
        num_sampled=rows,
    )
    assert graphs.serves(inputs)
    assert graphs._runs_fused(rows)
    with torch.inference_mode():
        fused = graphs.run(inputs)
        graphs.fused, kept = None, graphs.fused
        reference = graphs.run(inputs)
        graphs.fused = kept
    assert graphs.fused_steps == 1
    torch.testing.assert_close(fused.float(), reference.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "none"), ("float32", "int8"), ("bfloat16", "none")]
)
def test_tokens_match_eager_past_the_decoders_rows(checkpoints, dtype, quantization):
    """Batches from 1 to one past the decoder's rows (INT8: 5, past 4; bfloat16: 9, past 8;
    float32 without packed copies: 25, past 24), sequences joining and leaving: the graphs serve
    the widest steps, and the tokens are the eager engine's (bfloat16: rounded where it
    rounds)."""
    model_dir = checkpoints["llama-gqa"]
    widest = cpu_gemv.MAX_ROWS if quantization == "int8" else cpu_gemv.MAX_BF16_ROWS
    if (dtype, quantization) == ("float32", "none"):
        widest = cpu_gemv.MAX_GEMM_ROWS
    prompts = random_prompts(widest + 1, seed=21, max_len=24)
    kw = {"dtype": dtype, "quantization": quantization, "cpu_packed_gemm": False}
    compiled = make_engine(model_dir, enforce_eager=False, max_num_seqs=widest + 8, **kw)
    eager = make_engine(model_dir, **kw)
    got, expected = run_staggered(compiled, prompts, GREEDY), run_staggered(eager, prompts, GREEDY)
    if dtype == "bfloat16":
        _differ_only_at_near_ties(model_dir, prompts, got, expected)
    else:
        assert got == expected
    graphs = compiled.runner.graphs
    assert 0 < graphs.fused_steps < graphs.steps, "both paths served steps"
    assert graphs.recompiles == 0


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied"])
def test_packed_float32_steps_of_any_width_run_fused(checkpoints, variant):
    """With oneDNN-packed copies the decoder takes float32 steps of any width: a batch past 24
    rows runs in it, no graph is compiled, and the tokens are the eager engine's (with tied
    embeddings too, where the decoder looks tokens up in the LM head's column-major weight)."""
    model_dir = checkpoints[variant]
    prompts = random_prompts(cpu_gemv.MAX_GEMM_ROWS + 3, seed=23, max_len=24)
    compiled = _engine(model_dir, max_num_seqs=len(prompts), max_num_batched_tokens=1024)
    eager = make_engine(model_dir, dtype="float32", max_num_batched_tokens=1024)
    assert compiled.generate(prompts, GREEDY) == eager.generate(prompts, GREEDY)
    graphs = compiled.runner.graphs
    assert graphs.fused_steps == graphs.steps > 0
    assert graphs.compilations == 0


@pytest.mark.parametrize("drafts", [3, 7])
def test_speculative_rows_run_fused(checkpoints, drafts):
    """n-gram drafts at batch 1: verification steps of 1 + K rows (4, and 8: float32's row
    groups past 4) take the C++ decoder and accept what the eager path accepts."""
    model_dir = checkpoints["llama-gqa"]
    prompts = [p * 3 for p in random_prompts(1, seed=22, max_len=8)]
    spec = {"speculative": "ngram", "ngram_min": 1, "spec_token_cost": 0.0}
    spec["num_speculative_tokens"] = drafts
    compiled = _engine(model_dir, **spec)
    eager = make_engine(model_dir, dtype="float32", **spec)
    assert compiled.generate(prompts, GREEDY) == eager.generate(prompts, GREEDY)
    assert compiled.runner.graphs.verify_steps > 0 and compiled.runner.graphs.fused_steps > 0


def test_off_switch_and_unsupported_weights_keep_the_graphs(checkpoints):
    model_dir = checkpoints["llama-gqa"]
    assert _engine(model_dir, cpu_fused_decode=False).runner.graphs.fused is None
    # float64 linears are not what the kernels read
    assert make_engine(model_dir, enforce_eager=False).runner.graphs.fused is None


def test_a_token_outside_its_pages_is_refused(checkpoints):
    """The decoder writes each token's K/V through its table row: a position past the row, or a
    block the cache does not have, is an error rather than a write elsewhere in memory."""
    engine = _engine(checkpoints["llama-gqa"], num_kv_blocks=8)
    graphs = engine.runner.graphs
    fused, cos_sin = graphs.fused, graphs.model.cos_sin
    ids = torch.tensor([11])
    with torch.inference_mode():
        fused.forward(ids, torch.tensor([17]), torch.tensor([[3, 4]]), cos_sin)  # in block 4
        with pytest.raises(RuntimeError, match="past its table row"):
            fused.forward(ids, torch.tensor([32]), torch.tensor([[3, 4]]), cos_sin)
        with pytest.raises(RuntimeError, match="outside the pages"):
            fused.forward(ids, torch.tensor([17]), torch.tensor([[3, 8]]), cos_sin)
        with pytest.raises(RuntimeError, match="per token"):
            fused.forward(ids, torch.tensor([1, 2]), torch.tensor([[3, 4]]), cos_sin)


def test_float32_steps_of_5_rows_and_more_take_the_packed_copies(checkpoints):
    """From PACKED_FROM_ROWS rows the decoder's float32 projections run on oneDNN's packed
    copies, as the eager model's linears do; below, on the column-major kernel."""
    engine = _engine(checkpoints["llama-gqa"], num_kv_blocks=16)
    graphs = engine.runner.graphs
    fused, cos_sin = graphs.fused, graphs.model.cos_sin
    layers = len(graphs.model.decoder_layers())
    few = cpu_gemv.PACKED_FROM_ROWS
    with torch.inference_mode():
        for rows, packed_products in ((few - 1, 0), (few, 4 * layers)):
            before = cpu_gemv.packed_gemm_calls()
            ids = torch.arange(11, 11 + rows)
            fused.forward(ids, torch.arange(rows), torch.tensor([[1, 2]] * rows), cos_sin)
            assert cpu_gemv.packed_gemm_calls() - before == packed_products
