"""A guided request never emits a token its grammar refuses (issue 26).

The fault was in the sampler's noise: ``uniform_noise`` cast its float64 draws to float32, which
rounds those within 2^-25 of 1 up to 1.0. Every exponential race, argmax(p / E) with
E = -log(u), then divides by -0.0 there: a token of probability 0 (masked by a grammar, cut by
top-k or top-p) gets 0 / -0.0 = NaN, which argmax picks, and any other gets -inf, a certain loss.
Over SmolLM2's 49152 ids that is one row in ~700. Seed 12 drew u = 1.0 on token 15345 (" hash") at
output position 42: the issue's reproduction (tests/integration/test_guided_smollm2.py replays
it on the real model), pinned here on the sampler alone.

Then a property test: 200 seeds of every kind of guide at temperature 1 on the tiny checkpoint,
every output checked token by token against its grammar.
"""

from __future__ import annotations

import logging
import random

import torch
from tokenizers import Tokenizer

from pdserve.services.engine.sampler import SamplingTensors, sample, uniform_noise
from pdserve.shared.sampling import SamplingParams
from pdserve.shared.structured_output import compiler_for
from tests.engine_support import make_engine
from tests.guided_cases import GUIDES, assert_finished_valid, assert_tokens_obey

# A draw whose float32 noise used to be exactly 1.0 (see the module's docstring).
SEED, STEP, VOCAB, TOKEN = 12, 42, 49152, 15345


def test_the_noise_stays_below_one_where_float32_rounded_it_up():
    u = uniform_noise(torch.tensor([SEED]), torch.tensor([STEP]), VOCAB)[0]
    assert u[TOKEN].item() == 1.0 - 2.0**-24  # float32's nearest value below 1
    assert u.max() < 1 and u.min() > 0
    race = -torch.log(u)
    assert torch.isfinite(race).all() and (race > 0).all()


def _tensors(top_k: int = VOCAB, top_p: float = 1.0) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.ones(1), top_ks=torch.tensor([top_k]), top_ps=torch.tensor([top_p]),
        seeds=torch.tensor([SEED]), steps=torch.tensor([STEP]),
        needs_filter=top_k < VOCAB or top_p < 1.0, all_greedy=False,
    )  # fmt: skip


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


# ---- the engine: 200 seeds x every kind of guide ----------------------------------------------

EOS = 1  # tests.checkpoints' tokenizer
SEEDS = range(200)


def _whitespace_bias(tokenizer: Tokenizer) -> dict:
    """At temperature 1 a random model picks JSON's optional whitespace (up to 12 per gap) as
    often as anything, and objects rarely end within max_tokens. Disfavouring it lets most
    outputs finish; the mask, applied before the bias, still decides what is allowed."""
    ids = [i for i in range(5, tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip()]
    return dict(logit_bias_token_ids=ids, logit_bias_values=[-4.0] * len(ids))


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """request id -> (output tokens, finish_reason), every request batched together."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finished: dict[str, str] = {}
    while engine.has_unfinished():
        result = engine.step()
        for out in result.outputs if result else ():
            tokens[out.bus_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.bus_id] = out.finish_reason
    return {rid: (tokens[rid], finished[rid]) for rid in requests}


def test_200_seeds_of_every_guide_obey_it(llama_dir, caplog):
    """Temperature 1, batched: each output's tokens are ones its grammar allowed, in order;
    "stop" outputs parse and validate, "length" ones are prefixes. The worker's warning for a
    refused token must never appear."""
    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    compiler = compiler_for(llama_dir, vocab, (EOS,))
    engine = make_engine(llama_dir, dtype="float32", num_kv_blocks=2048, max_num_seqs=256,
                         max_num_batched_tokens=4096)  # fmt: skip
    bias = _whitespace_bias(tokenizer)
    rng = random.Random(26)
    requests = {
        f"{name}/{seed}": (
            [rng.randrange(5, vocab) for _ in range(rng.randint(1, 4))],
            SamplingParams(temperature=1.0, seed=seed, max_tokens=24, guided=guide, **bias),
        )
        for name, guide in GUIDES.items()
        for seed in SEEDS
    }
    with caplog.at_level(logging.WARNING):
        results = run(engine, requests)
    assert "broke its grammar" not in caplog.text
    stopped = dict.fromkeys(GUIDES, 0)
    for rid, (tokens, reason) in results.items():
        name = rid.split("/")[0]
        assert_tokens_obey(compiler, name, tokens, reason)
        if reason == "stop":
            stopped[name] += 1
            assert_finished_valid(name, tokenizer.decode(tokens[:-1], skip_special_tokens=False))
    # outputs of every guide end, so the parse-and-validate side is exercised for each
    assert all(n >= len(SEEDS) // 20 for n in stopped.values()), stopped
