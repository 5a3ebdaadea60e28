"""Speculative decoding keeps the output distribution through the engine: n-gram drafts on a
model with an 8-token vocabulary. The first output positions follow the same distributions as
the non-speculative sampler's, and - the sampler's own noise deciding each draft - every seeded
request emits exactly the tokens it emits with speculation off. The rejection sampler on its own
is tests/unit/test_rejection_sampler.py. Seeds are fixed, so the tests are deterministic."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from pdserve.services.engine.spec.ngram import NgramProposer
from pdserve.services.engine.spec.proposer import Proposal, Proposer
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine
from tests.unit.test_rejection_sampler import ALPHA, chi_square_p

# ---- the engine: n-gram drafts on an 8-token vocabulary -------------------------------------


def save_tiny_vocab_model(out):
    """A 2-layer Llama over an 8-token vocabulary (no tokenizer: ids only), seeded."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.3,
    )
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    return save_tiny_vocab_model(tmp_path_factory.mktemp("tiny-vocab"))


REQUESTS = 1500


def assert_same_law(
    spec: list[list[int]], plain: list[list[int]], pair: tuple[int, int] | None = None
) -> None:
    """Each output position's tokens, and the joint law of the ``pair`` of positions, are
    indistinguishable (chi-square) between the two sets of outputs."""
    for position in range(len(spec[0])):
        a = Counter(out[position] for out in spec)
        b = Counter(out[position] for out in plain)
        assert chi_square_p([a, b]) > ALPHA, position
    if pair is not None:
        i, j = pair
        assert chi_square_p([Counter((o[i], o[j]) for o in runs) for runs in (spec, plain)]) > ALPHA


PROMPT = [2, 3, 4, 5, 6, 2, 3, 4, 5, 7, 2, 3]  # any token drafts something


def outputs(engine, sp: SamplingParams, first_seed: int) -> list[list[int]]:
    params = [replace(sp, seed=first_seed + i) for i in range(REQUESTS)]
    return engine.generate([PROMPT] * REQUESTS, params)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
        SamplingParams(
            temperature=0.8, top_p=0.9, frequency_penalty=0.7, max_tokens=5, ignore_eos=True
        ),
    ],
    ids=["plain", "penalised"],
)
def test_first_positions_follow_the_non_speculative_sampler(tiny_vocab_dir, sp):
    options = dict(num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=4096)
    off = make_engine(tiny_vocab_dir, dtype="float32", **options)
    on = make_engine(
        tiny_vocab_dir,
        dtype="float32",
        speculative="ngram",
        ngram_min=1,
        spec_token_cost=0.0,
        **options,
    )
    spec = outputs(on, sp, 0)
    counters = on.stats().spec
    assert counters.drafts > REQUESTS  # nearly every request verified drafts...
    assert 0.1 < counters.accepted_tokens / counters.draft_tokens < 0.9  # ...some rejected
    plain_other_seeds = outputs(off, sp, REQUESTS)
    assert_same_law(spec, plain_other_seeds, pair=(1, 2))
    # exact, not only in law: the same seeds give the same tokens with speculation off
    assert outputs(off, sp, 0) == spec


class SmoothedNgram(Proposer):
    """Drafts drawn from a distribution, as a draft model's are: q puts 0.6 on the n-gram
    lookup's token and spreads the rest evenly; the draft is a draw from q (seeded)."""

    def __init__(self, vocab: int) -> None:
        self.lookup = NgramProposer(1, 4)
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(17)

    def propose(self, seqs, max_tokens):
        out = []
        for proposal in self.lookup.propose(seqs, max_tokens):
            if proposal is None:
                out.append(None)
                continue
            k = len(proposal.token_ids)
            q = torch.full((k, self.vocab), 0.4 / self.vocab)
            q[torch.arange(k), torch.tensor(proposal.token_ids)] += 0.6
            drafts = torch.multinomial(q, 1, generator=self.gen)[:, 0].tolist()
            out.append(Proposal(drafts, q))
        return out


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)])
def test_drafts_with_distributions_keep_the_sampler_s_law(tiny_vocab_dir, sp):
    """The draft-model path through the engine: q travels with each draft to the rejection
    sampler, batched with greedy rows, and the emitted tokens keep the plain sampler's law."""
    options = dict(num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=4096)
    off = make_engine(tiny_vocab_dir, dtype="float32", **options)
    on = make_engine(
        tiny_vocab_dir, dtype="float32", speculative="ngram", spec_token_cost=0.0, **options
    )
    on.speculator.proposer = SmoothedNgram(8)
    spec = outputs(on, sp, 0)
    counters = on.stats().spec
    assert counters.drafts > REQUESTS and 0.1 < counters.accepted_tokens / counters.draft_tokens
    assert_same_law(spec, outputs(off, sp, REQUESTS))
    # greedy rows beside them accept only the argmax: the same tokens as speculation off
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert on.generate([PROMPT] * 4, greedy) == off.generate([PROMPT] * 4, greedy)
