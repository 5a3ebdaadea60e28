"""Speculative decoding (n-gram) in the engine: the same tokens as speculation off and as HF,
in the continuous batch, with preemption, the prefix cache, stop tokens, max_tokens, min_tokens,
penalties, logit_bias, log-probs, n choices, guided output and pulled KV; every block back.

The tiny checkpoints' random weights fall into loops, which prompt lookup drafts well, and the
prompts repeat themselves so drafts come from the first decode step on; every test checks that
drafts were verified and accepted, so it exercises the path it claims to."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.sampling import GuidedDecoding, SamplingParams
from tests.engine.test_engine_lifecycle import all_free, prefill_one, pull
from tests.engine_support import make_engine, random_prompts, run_staggered, step_outputs
from tests.oracle import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# drafts as free (fixed K): the tiny model's own timings never decide what is tested
NGRAM = {"speculative": "ngram", "ngram_min": 1, "spec_token_cost": 0.0}


def repeating_prompts(n: int, seed: int, max_len: int = 30) -> list[list[int]]:
    """Prompts that quote themselves, so n-gram lookup finds matches at once."""
    return [p + p[: len(p) // 2] + p for p in random_prompts(n, seed, max_len=max_len)]


@dataclass
class Run:
    """Every choice's tokens, finish reason and log-probs, per request."""

    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    reasons: dict[tuple[str, int], str | None] = field(default_factory=dict)
    logprobs: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    top: dict[tuple[str, int], list[int]] = field(default_factory=dict)


def run(engine: LLMEngine, prompts: list[list[int]], sps: list[SamplingParams]) -> Run:
    out = Run()
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_unfinished():
        for o in step_outputs(engine):
            key = (o.bus_id, o.index)
            assert out.reasons.get(key) is None, f"{key} spoke after it ended"
            out.tokens.setdefault(key, []).extend(o.new_token_ids)
            out.reasons[key] = o.finish_reason
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.new_token_ids)
                out.logprobs.setdefault(key, []).extend(o.logprobs.token_logprobs)
                out.top.setdefault(key, []).extend(o.logprobs.top_token_ids)
    assert all_free(engine)
    return out


def spec(engine: LLMEngine):
    return engine.stats().spec


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied", "qwen2-bias"])
def test_greedy_matches_hf_with_drafts_in_a_running_batch(checkpoints, variant):
    model_dir = checkpoints[variant]
    prompts = repeating_prompts(6, seed=1)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    engine = make_engine(model_dir, **NGRAM)
    assert run_staggered(engine, prompts, GREEDY) == expected
    counters = spec(engine)
    assert counters.accepted_tokens > 0 and counters.draft_tokens > counters.accepted_tokens
    assert all_free(engine)


def test_preemption_and_small_budgets_keep_outputs_and_free_every_block(llama_dir):
    prompts = repeating_prompts(8, seed=2, max_len=24)
    sampling = replace(GREEDY, max_tokens=30)
    expected = hf_greedy(llama_dir, prompts, sampling.max_tokens)
    # 10 blocks of 16 for 8 sequences of up to ~90 tokens: preemption all along; a 40-token
    # budget cuts drafts short
    engine = make_engine(
        llama_dir, num_kv_blocks=10, prefix_cache=False, max_num_batched_tokens=40, **NGRAM
    )
    assert run_staggered(engine, prompts, sampling) == expected
    assert engine.stats().preemptions > 0 and spec(engine).accepted_tokens > 0
    assert all_free(engine)


def test_prefix_cache_holds_only_accepted_tokens(llama_dir):
    """Rolled-back KV never reaches the prefix cache: prompts that continue earlier outputs
    reuse their blocks and still generate what HF does."""
    first = repeating_prompts(4, seed=3)
    engine = make_engine(llama_dir, num_kv_blocks=128, **NGRAM)
    outputs = engine.generate(first, replace(GREEDY, max_tokens=40))
    assert spec(engine).draft_tokens > spec(engine).accepted_tokens > 0  # some were rejected
    hits = engine.stats().prefix_hits
    follow = [p + o[:33] for p, o in zip(first, outputs, strict=True)]
    assert engine.generate(follow, GREEDY) == hf_greedy(llama_dir, follow, GREEDY.max_tokens)
    assert engine.stats().prefix_hits - hits >= sum((len(p) - 1) // 16 for p in follow) - 4
    assert all_free(engine)


def test_every_sampling_control_gives_what_speculation_off_gives(llama_dir):
    """Stop tokens and EOS inside accepted drafts, max_tokens, min_tokens, penalties,
    logit_bias, seeded sampling, log-probs: token for token (and log-prob for log-prob) what
    the same engine generates without speculation."""
    prompts = repeating_prompts(4, seed=4)
    off = make_engine(llama_dir, num_kv_blocks=256)
    free = off.generate(prompts, GREEDY)
    sps = []
    for i, out in enumerate(free):
        stop = out[7 + i]  # a token some way into the output, often inside a draft
        sps += [
            replace(GREEDY, stop_token_ids=[stop]),
            replace(GREEDY, ignore_eos=False, stop_token_ids=[out[3]], min_tokens=9),
            replace(GREEDY, max_tokens=5 + 3 * i),
            replace(GREEDY, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
            replace(GREEDY, logit_bias_token_ids=[out[2], 7], logit_bias_values=[-5.0, 2.0]),
            replace(GREEDY, temperature=0.9, top_p=0.95, top_k=40, seed=11 + i, logprobs=3),
            replace(GREEDY, logprobs=2, frequency_penalty=0.3),
        ]
    many = [p for p in prompts for _ in range(7)]
    expected = run(off, many, sps)
    engine = make_engine(llama_dir, num_kv_blocks=256, **NGRAM)
    got = run(engine, many, sps)
    assert got.tokens == expected.tokens and got.reasons == expected.reasons
    assert got.top == expected.top
    for key, values in expected.logprobs.items():
        assert got.logprobs[key] == pytest.approx(values, abs=1e-9)
    assert {r for r in got.reasons.values()} == {"stop", "length"}
    assert spec(engine).accepted_tokens > 20


def test_n_choices_draft_independently_and_match_speculation_off(llama_dir):
    prompts = repeating_prompts(3, seed=5)
    sps = [
        SamplingParams(temperature=1.0, seed=s, n=3, max_tokens=20, ignore_eos=True)
        for s in (1, 2, 3)
    ] + [replace(GREEDY, n=2)]
    prompts = prompts + prompts[:1]
    off = run(make_engine(llama_dir, num_kv_blocks=256), prompts, sps)
    engine = make_engine(llama_dir, num_kv_blocks=256, **NGRAM)
    assert run(engine, prompts, sps).tokens == off.tokens
    assert spec(engine).drafts > 0


def test_guided_and_opted_out_requests_do_not_draft(llama_dir):
    prompt = repeating_prompts(1, seed=6)[0]
    engine = make_engine(llama_dir, **NGRAM)
    guided = replace(GREEDY, guided=GuidedDecoding("regex", "(ab|cd)+"))
    opted_out = replace(GREEDY, speculate=False)
    off = make_engine(llama_dir)
    assert engine.generate([prompt, prompt], [guided, opted_out]) == off.generate(
        [prompt, prompt], [guided, opted_out]
    )
    assert spec(engine).drafts == 0
    engine.generate([prompt], GREEDY)
    assert spec(engine).drafts > 0


def test_only_the_decode_side_drafts_after_a_pull(llama_dir):
    prefill = make_engine(llama_dir, prefill_only=True, **NGRAM)
    assert prefill.speculator is None
    prompt = repeating_prompts(1, seed=7)[0]
    expected = hf_greedy(llama_dir, [prompt], GREEDY.max_tokens)[0]
    first = prefill_one(prefill, "a", prompt)
    decode = make_engine(llama_dir, **NGRAM)
    decode.add_request("a", prompt, GREEDY, first.new_token_ids, remote_kv=True)
    result = decode.step()
    pull(decode, result, prefill, first.kv_block_ids)
    prefill.release("a")
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in step_outputs(decode) for t in o.new_token_ids]
    assert tokens == expected
    assert spec(decode).accepted_tokens > 0
    assert prefill.step() is None and all_free(prefill) and all_free(decode)


def test_a_step_verifies_drafts_beside_plain_decodes_and_prefill_chunks(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=128, **NGRAM)
    batches = []  # (batch, each row's draft length) as the forward pass saw them
    run_batch = engine.runner.run

    def spy(batch):
        batches.append((batch, [len(s.spec_token_ids) for s in batch.seqs]))
        return run_batch(batch)

    engine.runner.run = spy
    drafting = repeating_prompts(4, seed=4)
    fresh = [random_prompts(1, seed=9, max_len=1)[0] + list(range(5, 5 + 40 * i)) for i in (2, 4)]
    prompts = [*drafting, drafting[0], *fresh]
    sps = [GREEDY] * 4 + [replace(GREEDY, speculate=False)] + [GREEDY] * 2
    tokens: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        engine.add_request(f"r{i}", p, sp)  # each joins a batch that is already running
        for _ in range(2 if i < len(prompts) - 1 else 10**6):
            if not engine.has_unfinished():
                break
            for out in step_outputs(engine):
                tokens.setdefault(out.bus_id, []).extend(out.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(7)] == hf_greedy(llama_dir, prompts, GREEDY.max_tokens)
    assert all_free(engine)

    order = {"decode": 0, "verify": 1, "prefill": 2}

    def kinds(batch) -> list[str]:
        nd, nv = batch.num_decodes, batch.num_verifies
        return [
            "decode" if i < nd else "verify" if i < nd + nv else "prefill"
            for i in range(len(batch.seqs))
        ]

    for batch, drafts in batches:
        assert kinds(batch) == sorted(kinds(batch), key=order.get)
        for kind, draft, count in zip(kinds(batch), drafts, batch.num_new_tokens, strict=True):
            assert (kind == "verify") == (draft > 0)
            assert kind == "prefill" or count == 1 + draft
    assert any(set(kinds(b)) == set(order) for b, _ in batches)  # all three in one pass
