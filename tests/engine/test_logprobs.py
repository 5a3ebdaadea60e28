"""Log-probs of sampled tokens and of prompt tokens, against HF transformers' ``log_softmax`` of
the same tiny checkpoint's logits (the engine in float32, HF in float64: 1e-4 apart at most)."""

from __future__ import annotations

import random

import torch

import pdserve.services.engine.logprobs as logprobs_module
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepOutput
from pdserve.services.engine.sampler import SamplingTensors, sample
from pdserve.shared.sampling import MIN_LOGPROB, SamplingParams, TokenLogprobs
from tests.engine_support import make_engine, random_prompts, step_outputs
from tests.hf_reference import HFReference, assert_logprobs_match


def fp32_engine(llama_dir, **overrides) -> LLMEngine:
    return make_engine(llama_dir, dtype="float32", **overrides)


def long_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 380) for _ in range(length)]


def drain(engine: LLMEngine) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {}
    while engine.has_unfinished():
        for out in step_outputs(engine):
            outputs.setdefault(out.bus_id, []).append(out)
    return outputs


def joined_logprobs(outs: list[StepOutput]) -> TokenLogprobs:
    joined = TokenLogprobs()
    for out in outs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
        joined.extend(out.logprobs)
    return joined


def the_prompt_logprobs(outs: list[StepOutput]) -> TokenLogprobs:
    """Exactly one output carries them: the first, which completes the prefill."""
    carrying = [i for i, o in enumerate(outs) if o.prompt_logprobs is not None]
    assert carrying == [0]
    return outs[0].prompt_logprobs


def check_prompt_logprobs(got: TokenLogprobs, hf: HFReference, prompt: list[int], k: int):
    ref = hf.logprobs(prompt)
    assert_logprobs_match(got, ref[:-1], prompt[1:], k)


def test_sampled_token_logprobs_match_hf_in_one_batch(llama_dir, hf):
    engine = fp32_engine(llama_dir)
    prompts = random_prompts(4, seed=21)
    params = {
        "greedy-5": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5),
        # taken before temperature: the same values as at temperature 1
        "t0.7-3": SamplingParams(
            temperature=0.7, seed=4, max_tokens=10, ignore_eos=True, logprobs=3
        ),
        "none": SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True),
        "greedy-0": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0),
    }
    for (rid, sp), prompt in zip(params.items(), prompts, strict=True):
        engine.add_request(rid, prompt, sp)
    outputs = drain(engine)
    assert all(o.logprobs is None for o in outputs["none"])
    ranks_seen = []
    for (rid, sp), prompt in zip(params.items(), prompts, strict=True):
        if sp.logprobs is None:
            continue
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        assert len(tokens) == 10
        got = joined_logprobs(outputs[rid])
        ref = hf.logprobs(prompt + tokens)[len(prompt) - 1 : -1]
        assert_logprobs_match(got, ref, tokens, sp.logprobs)
        ranks_seen += got.ranks
        if sp.greedy:
            assert set(got.ranks) == {1}
    assert max(ranks_seen) > 1  # the temperature-0.7 row drew some token other than the likeliest


def test_prompt_logprobs_chunked_and_beside_a_warm_prefix_cache(llama_dir, hf):
    engine = fp32_engine(llama_dir, max_num_batched_tokens=24)  # 70 tokens: several chunks
    prompt = long_prompt(seed=22, length=70)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # warm the cache
    hits = engine.stats().prefix_hits
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    outs = drain_one(engine, prompt, sp)
    check_prompt_logprobs(the_prompt_logprobs(outs), hf, prompt, 4)
    assert outs[0].num_prefix_hit_tokens == 0 and engine.stats().prefix_hits == hits
    assert outs[0].logprobs is None  # not asked for the sampled tokens
    # the cache was warm: a request without prompt log-probs takes its hit
    plain = drain_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[0].num_prefix_hit_tokens == 64


def test_prompt_logprob_sequences_register_their_blocks_for_others(llama_dir):
    engine = fp32_engine(llama_dir)
    prompt = long_prompt(seed=23, length=40)
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    assert len(drain_one(engine, prompt, sp)[0].prompt_logprobs) == len(prompt) - 1
    outs = drain_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    assert outs[0].num_prefix_hit_tokens == 32  # two full blocks of the first request's prompt


def drain_one(engine: LLMEngine, prompt: list[int], sp: SamplingParams) -> list[StepOutput]:
    rid = f"q{random.random()}"
    engine.add_request(rid, prompt, sp)
    return drain(engine)[rid]


def test_prompt_logprobs_are_computed_in_bounded_slices(llama_dir, hf, monkeypatch):
    monkeypatch.setattr(logprobs_module, "PROMPT_SLICE", 8)
    engine = fp32_engine(llama_dir, max_num_batched_tokens=64)
    model = engine.runner.model
    head_rows: list[int] = []
    real_head = model.compute_logits
    model.compute_logits = lambda h: head_rows.append(h.shape[0]) or real_head(h)
    prompt = long_prompt(seed=24, length=50)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outs = drain_one(engine, prompt, sp)
    check_prompt_logprobs(the_prompt_logprobs(outs), hf, prompt, 2)
    assert max(head_rows) <= 8 and sum(head_rows) == 49 + 2  # 49 prompt entries, 2 samples


def test_max_tokens_zero_returns_prompt_logprobs_and_no_token(llama_dir, hf):
    engine = fp32_engine(llama_dir, max_num_batched_tokens=16)
    prompt = long_prompt(seed=25, length=37)
    (out,) = drain_one(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert out.new_token_ids == [] and out.finish_reason == "length" and out.logprobs is None
    check_prompt_logprobs(out.prompt_logprobs, hf, prompt, 3)
    (out,) = drain_one(engine, prompt, SamplingParams(max_tokens=0))
    assert (out.new_token_ids, out.finish_reason, out.prompt_logprobs) == ([], "length", None)
    (out,) = drain_one(engine, [7], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert len(out.prompt_logprobs) == 0  # a one-token prompt has nothing to score
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and not (stats.running or stats.waiting)


def test_a_prefill_only_engine_returns_first_token_and_prompt_logprobs(llama_dir, hf):
    prefill = fp32_engine(llama_dir, prefill_only=True, max_num_batched_tokens=16)
    prompt = long_prompt(seed=26, length=30)
    sp = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    (first,) = drain_one(prefill, prompt, sp)
    assert first.kv_block_ids and first.finish_reason is None
    check_prompt_logprobs(first.prompt_logprobs, hf, prompt, 2)
    ref = hf.logprobs(prompt)[-1:]
    assert_logprobs_match(first.logprobs, ref, first.new_token_ids, 2)
    prefill.release(first.bus_id)
    (done,) = drain_one(prefill, prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert done.finish_reason == "length" and done.kv_block_ids is None
    check_prompt_logprobs(done.prompt_logprobs, hf, prompt, 2)
    prefill.step()
    assert prefill.stats().free_blocks == prefill.stats().total_blocks

    # the decode side continues after the first token: it never sends prompt log-probs again
    decode = fp32_engine(llama_dir)
    decode.add_request("d", prompt, sp, first.new_token_ids)
    outs = drain(decode)["d"]
    assert all(o.prompt_logprobs is None for o in outs)
    tokens = first.new_token_ids + [t for o in outs for t in o.new_token_ids]
    ref = hf.logprobs(prompt + tokens)[len(prompt) : -1]
    assert_logprobs_match(joined_logprobs(outs), ref, tokens[1:], 2)


def test_preemption_mid_prefill_neither_duplicates_nor_loses_prompt_logprobs(llama_dir, hf):
    # B decodes and grows; A, admitted later, prefills in 15-token chunks beside it. When B
    # needs a block, A (the newest) is preempted with part of its prompt log-probs gathered,
    # and recomputed from its first token.
    engine = fp32_engine(llama_dir, num_kv_blocks=8, max_num_batched_tokens=16, prefix_cache=False)
    prompt_b, prompt_a = long_prompt(seed=27, length=27), long_prompt(seed=28, length=90)
    sp_b = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    sp_a = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("b", prompt_b, sp_b)
    step_outputs(engine)
    engine.add_request("a", prompt_a, sp_a)
    outputs: dict[str, list[StepOutput]] = {}
    preempted_mid_prompt = False
    while engine.has_unfinished():
        for out in step_outputs(engine):
            outputs.setdefault(out.bus_id, []).append(out)
        a = engine.scheduler.seqs.get("a")
        if a is not None and a.num_computed_tokens == 0 and len(a.prompt_logprobs_so_far):
            preempted_mid_prompt = True
    assert preempted_mid_prompt and engine.stats().preemptions > 0
    check_prompt_logprobs(the_prompt_logprobs(outputs["a"]), hf, prompt_a, 1)
    tokens_b = [t for o in outputs["b"] for t in o.new_token_ids]
    ref = hf.logprobs(prompt_b + tokens_b)[len(prompt_b) - 1 : -1]
    assert_logprobs_match(joined_logprobs(outputs["b"]), ref, tokens_b, 1)


def test_masked_tokens_report_min_logprob():
    logits = torch.randn(2, 70)
    allowed = [[3, 40, 64], list(range(70))]
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    st = SamplingTensors(
        temperatures=torch.zeros(2),
        top_ks=torch.full((2,), 70),
        top_ps=torch.ones(2),
        seeds=torch.zeros(2, dtype=torch.int64),
        steps=torch.zeros(2, dtype=torch.int64),
        needs_filter=False,
        all_greedy=True,
        token_bitmask=bitmask,
        logprob_rows=torch.tensor([0, 1]),
        num_logprobs=5,
    )
    out = sample(logits, st)
    assert out.tokens[0].item() in allowed[0] and out.tokens[1] == logits[1].argmax()
    top = out.logprobs.top_logprobs
    assert set(out.logprobs.top_ids[0, :3].tolist()) == set(allowed[0])
    assert top[0, 3:].tolist() == [MIN_LOGPROB, MIN_LOGPROB]  # -inf travels as MIN_LOGPROB
    assert torch.isfinite(top).all() and out.logprobs.ranks.tolist() == [1, 1]
    ref = torch.log_softmax(logits[1], dim=-1)
    assert torch.allclose(top[1], ref.topk(5).values)
