"""The sampling controls (penalties, logit_bias, min_tokens, the allowed-token bitmask) against a
plain per-row Python reference of the same formulas, on a tiny model's logits; then in the
engine, against a greedy loop over HF transformers' logits processed by that reference."""

from __future__ import annotations

import math
import random
from collections import Counter

import torch

from pdserve.services.engine.sampler import apply_token_bitmask, process_logits
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts

EOS = (1,)  # the tiny checkpoints' eos_token_id


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams):
    """One row, token by token: the formulas as HF/vLLM (repetition) and OpenAI (frequency,
    presence) write them, then logit_bias, then min_tokens."""
    out = logits.clone()
    if sp.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            r = sp.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t, count in Counter(output).items():
        out[t] -= count * sp.frequency_penalty + sp.presence_penalty
    for t, bias in sp.logit_bias.items():
        out[t] += bias
    if len(output) < sp.min_tokens:
        for t in set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(EOS)):
            out[t] = -math.inf
    return out


CASES = [
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
    SamplingParams(),  # untouched
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(
        frequency_penalty=-0.7,
        logit_bias_token_ids=[5, 17, 5],
        logit_bias_values=[3.0, -100.0, 2.0],
        min_tokens=4,
        stop_token_ids=[9, 10],
    ),
    SamplingParams(min_tokens=2, ignore_eos=True, presence_penalty=-1.5),  # enough tokens: no mask
    SamplingParams(min_tokens=9, ignore_eos=True, stop_token_ids=[12]),  # masks 12, not EOS
]


def test_each_control_matches_the_reference_on_model_logits(llama_dir, hf):
    engine = make_engine(llama_dir, dtype="float32")
    rng = random.Random(31)
    prompts = random_prompts(len(CASES), seed=31, max_len=20)
    seqs, rows = [], []
    for i, (sp, prompt) in enumerate(zip(CASES, prompts, strict=True)):
        output = [rng.choice(prompt + [rng.randrange(5, 380)]) for _ in range(rng.randint(2, 6))]
        output += [output[0]]  # a repeated token: counts above 1
        seq = Sequence(f"r{i}", prompt, sp, seed=i, arrival=0.0)
        seq.token_ids.extend(output if i != 3 else output[:2])  # row 3 is short of min_tokens
        seqs.append(seq)
        rows.append(hf.logits(seq.token_ids)[-1])
    logits = torch.stack(rows).float()
    processed = process_logits(logits, engine.runner._sampling_tensors(seqs))
    for i, seq in enumerate(seqs):
        expected = reference(
            rows[i], seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, seq.sampling
        ).float()
        assert torch.allclose(processed[i], expected, atol=1e-5), i
    assert torch.equal(processed[1], logits[1])  # a row that uses nothing is left exactly
    assert processed[3, 9] == processed[3, 10] == processed[3, 1] == -math.inf
    assert processed[3, 17] < logits[3, 17] - 99 and processed[5, 1] == logits[5, 1]
    assert processed[5, 12] == -math.inf and processed[4].isfinite().all()


def test_token_bitmask_allows_exactly_its_bits():
    gen = torch.Generator().manual_seed(32)
    vocab = 100  # 4 words; bit 31 (the sign bit) of each word is exercised
    logits = torch.randn(3, vocab, generator=gen)
    bits = torch.rand(3, 128, generator=gen) < 0.4
    bits[:, 31] = bits[:, 63] = True
    words = torch.zeros(3, 4, dtype=torch.int64)
    for j in range(32):
        words |= bits[:, j::32].to(torch.int64) << j
    bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    masked = apply_token_bitmask(logits.clone(), bitmask)
    allowed = bits[:, :vocab]
    assert torch.equal(masked[allowed], logits[allowed])
    assert (masked[~allowed] == -math.inf).all()
    # a mask narrower than the logits (a vocabulary padded past the tokenizer's): the rest is out
    narrow = apply_token_bitmask(logits.clone(), bitmask[:, :2])
    assert (narrow[:, 64:] == -math.inf).all() and torch.equal(narrow[:, :64], masked[:, :64])


def test_greedy_takes_the_argmax_of_the_processed_logits(llama_dir, hf):
    engine = make_engine(llama_dir)
    prompt = random_prompts(1, seed=33)[0]
    plain = hf.greedy(prompt, 6, lambda logits, out: logits)
    # ban the greedy choice at every step, and penalise repeats
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=6,
        ignore_eos=True,
        repetition_penalty=1.5,
        logit_bias_token_ids=[plain[0]],
        logit_bias_values=[-100.0],
    )
    expected = hf.greedy(prompt, 6, lambda logits, out: reference(logits, prompt, out, sp))
    assert plain[0] not in expected
    assert engine.generate([prompt], sp) == [expected]


def test_logit_bias_forces_a_token(llama_dir):
    engine = make_engine(llama_dir)
    prompts = random_prompts(2, seed=34)
    force = dict(logit_bias_token_ids=[42], logit_bias_values=[100.0], max_tokens=5)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, **force)
    sampled = SamplingParams(temperature=1.0, seed=3, ignore_eos=True, **force)
    assert engine.generate(prompts, [greedy, sampled]) == [[42] * 5, [42] * 5]


def test_min_tokens_delays_eos(llama_dir, hf):
    engine = make_engine(llama_dir)
    prompt = random_prompts(1, seed=35)[0]
    eos_forced = dict(logit_bias_token_ids=[EOS[0]], logit_bias_values=[100.0], max_tokens=10)
    assert engine.generate([prompt], SamplingParams(temperature=0.0, **eos_forced)) == [[EOS[0]]]
    sp = SamplingParams(temperature=0.0, min_tokens=4, **eos_forced)
    engine.add_request("m", prompt, sp)
    outs = []
    while engine.has_unfinished():
        result = engine.step()
        outs += [o for o in (result.outputs if result else []) if o.bus_id == "m"]
    tokens = [t for o in outs for t in o.new_token_ids]
    expected = hf.greedy(prompt, 5, lambda logits, out: reference(logits, prompt, out, sp))
    assert tokens == expected and tokens[4] == EOS[0] and EOS[0] not in tokens[:4]
    assert outs[-1].finish_reason == "stop"
    # a stop token id is held back the same way
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=6,
        min_tokens=3,
        stop_token_ids=[42],
        logit_bias_token_ids=[42],
        logit_bias_values=[100.0],
    )
    (tokens,) = engine.generate([prompt], sp)
    assert len(tokens) == 4 and tokens[3] == 42 and 42 not in tokens[:3]


def test_a_mixed_batch_processes_only_the_rows_that_ask(llama_dir, hf):
    engine = make_engine(llama_dir)
    prompts = random_prompts(5, seed=36)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        presence_penalty=1.2,
        frequency_penalty=0.8,
        repetition_penalty=1.4,
    )
    biased = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=2,
        logit_bias_token_ids=[7, 8],
        logit_bias_values=[2.5, -3.0],
    )
    params = [greedy, penalised, seeded, biased, greedy]
    batched = engine.generate(prompts, params)
    for prompt, sp, got in zip(prompts, params, batched, strict=True):
        if sp is seeded:
            # a seeded request samples the same tokens alone as beside processed rows
            assert engine.generate([prompt], sp) == [got]
        else:
            ref = hf.greedy(
                prompt, 8, lambda logits, out, p=prompt, s=sp: reference(logits, p, out, s)
            )
            assert got == ref
    assert batched[1] != hf.greedy(prompts[1], 8, lambda logits, out: logits)  # penalties bite
