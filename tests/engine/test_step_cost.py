"""A real engine's per-step roofline counts (services/engine/step_cost.py): the StepStats of a
prefill, a chunked prefill, a decode batch, n-gram verifications, prompt log-probs, and INT8
weights with an int8 KV cache carry exactly the FLOPs and bytes the hand formula gives for the
batch each step ran, on the tiny llama-gqa checkpoint (tests/checkpoints.py):

    2 layers, hidden 64, 4 query heads and 2 KV heads of 16, 128 MLP channels, untied head
    linear weights: 2 x (64 x (64 + 2 x 32) + 64 x 64 + 3 x 64 x 128) = 2 x 36,864 = 73,728
    FLOPs = 2 x 73,728 x tokens + 4 x 2 x 4 x 16 x pairs + 2 x 64 x vocab x logit rows
    bytes = weights + head (when logits) + 64 x e x tokens + kv_token x (read + tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepStats
from pdserve.shared.sampling import SamplingParams
from tests.engine.test_spec_engine import NGRAM, repeating_prompts
from tests.engine_support import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LINEAR_PARAMS = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
# every layer's linear outputs (qkv 128 + o 64 + gate/up 256 + down 64): INT8 scales per channel
LINEAR_CHANNELS = 2 * 512


@dataclass
class Row:
    """One row of a step as the runner saw it (captured before the pass)."""

    start: int  # tokens already in the cache
    count: int  # tokens computed
    drafts: int  # a verification row's draft tokens
    ends: bool  # its last token is the sequence's last known one: it samples
    kind: str  # decode, verify or prefill


@dataclass
class Geometry:
    elem: int  # bytes of a float weight / embedding value
    weight_bytes: int  # every layer's linear weights as stored
    head_bytes: int
    kv_token: int  # one token's K and V over both layers
    prefill_reads_cache: bool = False  # a quantized cache: prompt chunks attend through pages


def fp(vocab: int, elem: int) -> Geometry:
    return Geometry(elem, LINEAR_PARAMS * elem, 64 * vocab * elem, 2 * 2 * 2 * 16 * elem)


def expected(rows: list[Row], g: Geometry, vocab: int, prompt_logprob_rows: int = 0):
    """The hand formula (the module docstring) over the rows a step ran."""
    tokens = sum(r.count for r in rows)
    # a token at position p attends to p + 1 positions
    pairs = sum(sum(p + 1 for p in range(r.start, r.start + r.count)) for r in rows)
    prefills = [r for r in rows if r.kind == "prefill"]
    paged_prefill = g.prefill_reads_cache or any(r.start > 0 for r in prefills)
    read = sum(r.start + r.count for r in rows if r.kind != "prefill" or paged_prefill)
    sampled = sum(1 + r.drafts for r in rows if r.ends)
    logit_rows = sampled + prompt_logprob_rows
    flops = 2 * LINEAR_PARAMS * tokens + 4 * 2 * 4 * 16 * pairs + 2 * 64 * vocab * logit_rows
    calls = (sampled > 0) + (prompt_logprob_rows > 0)  # fewer than 256 prompt rows: one slice
    moved = g.weight_bytes + g.head_bytes * calls + 64 * g.elem * tokens
    return flops, moved + g.kv_token * (read + tokens)


def run_steps(engine: LLMEngine) -> list[tuple[list[Row], StepStats]]:
    """Step ``engine`` to the end: each forward pass's rows and its stats."""
    seen: list[list[Row]] = []
    run_batch = engine.runner.run

    def spy(batch):
        nd, nv = batch.num_decodes, batch.num_verifies
        seen.append(
            [
                Row(
                    s.num_computed_tokens,
                    n,
                    len(s.spec_token_ids),
                    s.num_computed_tokens + n - len(s.spec_token_ids) == s.num_tokens,
                    "decode" if i < nd else "verify" if i < nd + nv else "prefill",
                )
                for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
            ]
        )
        return run_batch(batch)

    engine.runner.run = spy
    steps = []
    while engine.has_unfinished():
        result = engine.step()
        if result is not None and result.stats.num_seqs:
            steps.append((seen[-1], result.stats))
    assert len(steps) == len(seen)
    return steps


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return make_engine(llama_dir)  # float64: 8 bytes a value


def test_a_prefill_batch_then_decode_steps(engine) -> None:
    vocab = engine.model_config.vocab_size
    engine.add_request("a", list(range(5, 15)), GREEDY)
    engine.add_request("b", list(range(5, 25)), GREEDY)
    steps = run_steps(engine)
    (rows, first), (rows2, second) = steps[0], steps[1]
    assert [(r.start, r.count, r.kind) for r in rows] == [(0, 10, "prefill"), (0, 20, "prefill")]
    # 30 tokens, 55 + 210 pairs, two rows of logits; fresh prompts read no page
    flops = 2 * 73_728 * 30 + 4 * 2 * 4 * 16 * (55 + 210) + 2 * 64 * vocab * 2
    moved = 73_728 * 8 + 64 * vocab * 8 + 30 * 64 * 8 + 30 * 1024  # K/V written: 1 KiB a token
    assert (first.flops, first.bytes) == (flops, moved)
    assert first.phase == "prefill" and first.seconds > 0
    assert [(r.start, r.count, r.kind) for r in rows2] == [(10, 1, "decode"), (20, 1, "decode")]
    # positions 10 and 20 attend to 11 + 21 keys, read through the pages
    flops = 2 * 73_728 * 2 + 4 * 2 * 4 * 16 * 32 + 2 * 64 * vocab * 2
    moved = 73_728 * 8 + 64 * vocab * 8 + 2 * 64 * 8 + (32 + 2) * 1024
    assert (second.flops, second.bytes) == (flops, moved) and second.phase == "decode"
    for rows, stats in steps:
        assert (stats.flops, stats.bytes) == expected(rows, fp(vocab, 8), vocab)


def test_chunks_read_their_cached_prefix_and_only_the_last_computes_logits(llama_dir) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=16)
    vocab = engine.model_config.vocab_size
    engine.add_request("long", list(range(5, 45)), GREEDY)
    steps = run_steps(engine)
    chunks = [rows[0] for rows, _ in steps[:3]]
    assert [(r.start, r.count, r.ends) for r in chunks] == [
        (0, 16, False),
        (16, 16, False),
        (32, 8, True),
    ]
    middle = steps[1][1]
    pairs = 16 * 16 + 16 * 17 // 2  # positions 16..31
    flops = 2 * 73_728 * 16 + 4 * 2 * 4 * 16 * pairs  # no LM head, no head weight read
    assert (middle.flops, middle.bytes) == (flops, 73_728 * 8 + 16 * 512 + (32 + 16) * 1024)
    for rows, stats in steps:
        assert (stats.flops, stats.bytes) == expected(rows, fp(vocab, 8), vocab)


def test_prompt_logprobs_put_their_rows_through_the_lm_head(engine) -> None:
    vocab = engine.model_config.vocab_size
    engine.add_request("lp", list(range(5, 17)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    (rows, stats), *_ = run_steps(engine)
    # the sampled row, and the 11 prompt positions after the first (in a second head call)
    assert (stats.flops, stats.bytes) == expected(rows, fp(vocab, 8), vocab, 11)


def test_verification_rows(llama_dir) -> None:
    engine = make_engine(llama_dir, num_kv_blocks=128, **NGRAM)
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(repeating_prompts(3, seed=4)):
        engine.add_request(f"s{i}", prompt, sp)
    steps = run_steps(engine)
    verifying = [(rows, s) for rows, s in steps if any(r.kind == "verify" for r in rows)]
    assert verifying, "no step verified a draft"
    assert any(r.drafts > 1 for rows, _ in verifying for r in rows)
    for rows, stats in steps:
        assert (stats.flops, stats.bytes) == expected(rows, fp(vocab, 8), vocab)
        assert stats.phase == ("prefill" if any(r.kind == "prefill" for r in rows) else "decode")


def test_int8_weights_and_an_int8_kv_cache(llama_dir) -> None:
    engine = make_engine(llama_dir, dtype="float32", quantization="int8", kv_cache_dtype="int8")
    vocab = engine.model_config.vocab_size
    engine.add_request("q", list(range(5, 25)), GREEDY)
    steps = run_steps(engine)
    g = Geometry(
        elem=4,  # the embedding stays float32
        weight_bytes=LINEAR_PARAMS + LINEAR_CHANNELS * 4,  # a byte each, a float32 scale a row
        head_bytes=64 * vocab + vocab * 4,
        kv_token=2 * 2 * 2 * (16 + 4),  # int8 values and a float32 scale per token and head
        prefill_reads_cache=True,
    )
    (rows, prefill), (_, decode) = steps[0], steps[1]
    # the fresh prompt's chunk reads its own 20 tokens' K/V back through the pages
    assert prefill.bytes == g.weight_bytes + g.head_bytes + 20 * 256 + (20 + 20) * 160
    for rows, stats in steps:
        assert (stats.flops, stats.bytes) == expected(rows, g, vocab)
    fp32 = make_engine(llama_dir, dtype="float32")
    fp32.add_request("q", list(range(5, 25)), GREEDY)
    (_, base), (_, base_decode) = run_steps(fp32)[:2]
    assert base.flops == prefill.flops and base_decode.bytes > 3 * decode.bytes


def test_tensor_parallel_counts_rank_0s_shard(llama_dir) -> None:
    """At TP 2 rank 0 holds 2 query heads, 1 KV head, 64 MLP channels and half the vocabulary
    rows of the (vocab-parallel) LM head: it counts what it computes, half of every layer."""
    engine = make_engine(llama_dir, tensor_parallel_size=2)
    try:
        vocab = engine.model_config.vocab_size
        rows = -(-vocab // 2)  # each rank's rows, the last zero-padded
        engine.add_request("tp", list(range(5, 25)), GREEDY)
        (_, prefill), (_, decode) = run_steps(engine)[:2]
    finally:
        engine.close()
    # 20 tokens, 210 pairs over 2 heads, one row of logits over rank 0's rows; K/V: 512 bytes
    flops = 2 * (73_728 // 2) * 20 + 4 * 2 * 2 * 16 * 210 + 2 * 64 * rows
    moved = 73_728 // 2 * 8 + 64 * rows * 8 + 20 * 512 + 20 * 512
    assert (prefill.flops, prefill.bytes) == (flops, moved)
    flops = 2 * (73_728 // 2) + 4 * 2 * 2 * 16 * 21 + 2 * 64 * rows
    assert decode.flops == flops
    assert decode.bytes == 73_728 // 2 * 8 + 64 * rows * 8 + 512 + (21 + 1) * 512
