from __future__ import annotations

import math

import torch

from pdserve.services.engine.sampler import SamplingTensors, SparseLogits, sample, uniform_noise


def tensors(
    b: int, temp: float, top_k: int, top_p: float, seeds: list[int], vocab: int
) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.full((b,), temp),
        top_ks=torch.full((b,), top_k if top_k > 0 else vocab),
        top_ps=torch.full((b,), top_p),
        seeds=torch.tensor(seeds),
        steps=torch.zeros(b, dtype=torch.int64),
        needs_filter=top_k > 0 or top_p < 1.0,
        all_greedy=temp == 0,
    )


def test_noise_is_uniform_and_deterministic():
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 50_000)
    assert torch.equal(u, uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 50_000))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = probs.log().expand(n, 4).contiguous()
    tokens = sample(logits, tensors(n, 1.0, -1, 1.0, list(range(n)), 4)).tokens
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015)


def test_top_k_and_top_p_filter():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    top2 = sample(logits, tensors(n, 1.0, 2, 1.0, list(range(n)), 4)).tokens
    assert set(top2.tolist()) == {0, 1}
    # top_p 0.6: the smallest prefix reaching 0.6 is {0, 1}
    nucleus = sample(logits, tensors(n, 1.0, -1, 0.6, list(range(n)), 4)).tokens
    assert set(nucleus.tolist()) == {0, 1}
    assert sample(logits[:8], tensors(8, 1.0, 1, 1.0, list(range(8)), 4)).tokens.tolist() == [0] * 8


def test_greedy_rows_in_a_mixed_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    st = tensors(2, 1.0, -1, 1.0, [3, 4], 3)
    st.temperatures = torch.tensor([0.0, 1.0])
    st.all_greedy = False
    assert sample(logits, st).tokens[0].item() == 1


def test_a_seeded_row_samples_the_same_beside_processed_rows():
    gen = torch.Generator().manual_seed(41)
    logits = torch.randn(64, 50, generator=gen)
    plain = sample(logits[:32], tensors(32, 0.8, 20, 0.9, list(range(32)), 50))
    assert plain.logprobs is None
    # the same 32 rows, then 32 rows with a bias, a min_tokens mask and log-probs asked
    st = tensors(64, 0.8, 20, 0.9, list(range(32)) + list(range(100, 132)), 50)
    others = torch.arange(32, 64)
    st.logit_bias = SparseLogits(others, torch.full((32,), 3), torch.full((32,), 4.0))
    st.min_tokens_mask = SparseLogits(others, torch.full((32,), 1), torch.full((32,), -math.inf))
    st.logprob_rows, st.num_logprobs = torch.tensor([0, 40]), 3
    mixed = sample(logits, st)
    assert torch.equal(mixed.tokens[:32], plain.tokens)
    assert (mixed.tokens[32:] != 1).all() and (mixed.tokens[32:] == 3).sum() > 8
    assert mixed.logprobs.top_ids.shape == (2, 3)


# ---- issue 26: a guided request never emits a token its grammar refuses --------------------
# The fault was in the noise: ``uniform_noise`` cast its float64 draws to float32, which rounds
# those within 2^-25 of 1 up to 1.0. Every exponential race, argmax(p / E) with E = -log(u), then
# divides by -0.0 there: a token of probability 0 (masked by a grammar, cut by top-k or top-p)
# gets 0 / -0.0 = NaN, which argmax picks, and any other gets -inf, a certain loss. Over
# SmolLM2's 49152 ids that is one row in ~700. Seed 12 drew u = 1.0 on token 15345 (" hash") at
# output position 42: the reproduction, pinned here on the sampler alone (the property
# test over an engine is tests/engine/test_guided_sampling.py, the real model
# tests/integration/test_guided_smollm2.py).

SEED, STEP, VOCAB, TOKEN = 12, 42, 49152, 15345


def test_the_noise_stays_below_one_where_float32_rounded_it_up():
    u = uniform_noise(torch.tensor([SEED]), torch.tensor([STEP]), VOCAB)[0]
    assert u[TOKEN].item() == 1.0 - 2.0**-24  # float32's nearest value below 1
    assert u.max() < 1 and u.min() > 0
    race = -torch.log(u)
    assert torch.isfinite(race).all() and (race > 0).all()


def _tensors(top_k: int = VOCAB, top_p: float = 1.0) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.ones(1),
        top_ks=torch.tensor([top_k]),
        top_ps=torch.tensor([top_p]),
        seeds=torch.tensor([SEED]),
        steps=torch.tensor([STEP]),
        needs_filter=top_k < VOCAB or top_p < 1.0,
        all_greedy=False,
    )


def _logits() -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))


def test_a_token_the_mask_refuses_is_never_drawn():
    allowed = [2, 198, 4000, 30000]
    mask = torch.zeros(1, VOCAB // 32, dtype=torch.int64)
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32)
    st = _tensors()
    st.token_bitmask = torch.where(mask >= 1 << 31, mask - (1 << 32), mask).to(torch.int32)
    assert sample(_logits(), st).tokens.item() in allowed


def test_a_token_top_k_or_top_p_cut_is_never_drawn():
    logits = _logits()
    top5 = set(logits[0].topk(5).indices.tolist())
    assert sample(logits, _tensors(top_k=5)).tokens.item() in top5
    assert sample(logits, _tensors(top_p=1e-6)).tokens.item() == logits.argmax().item()


def test_the_token_drawn_at_one_is_not_excluded_either():
    """The other half: -log(1.0) is -0.0, so a token of probability p > 0 got p / -0.0 = -inf
    and could not be drawn, however likely."""
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, TOKEN] = 0.0  # all but ~5e-9 of the mass
    assert sample(logits, _tensors()).tokens.item() == TOKEN
