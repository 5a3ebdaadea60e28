"""Speculative decoding keeps the output distribution, on the sampler alone: chi-square tests on
tiny vocabularies for the rejection sampler with drafts of a distribution q
(``spec/rejection.py``) - emitted tokens follow the target p for several (p, q) pairs, with
temperature and top-k - and the bookkeeping around it: accepted lengths, the tokens emitted, a
draft position's view of its sequence, and the blocks a rollback frees. The same laws through a
whole engine are tests/engine/test_spec_rejection.py. Seeds are fixed, so the tests are
deterministic."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.sampler import SamplingTensors, sample
from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.spec.rejection import DraftDistributions
from pdserve.services.engine.spec.verify import DraftPosition, accepted_lengths, emitted_tokens
from pdserve.shared.sampling import SamplingParams

V = 6
N = 20_000
ALPHA = 1e-3  # a correct sampler fails a test at this level one time in a thousand


def chi_square_p(observed: list[Counter], min_expected: float = 5.0) -> float:
    """p-value of a chi-square homogeneity test of ``observed`` samples (one Counter each),
    categories with small expected counts pooled."""
    keys = sorted(set().union(*observed))
    table = torch.tensor([[c[k] for k in keys] for c in observed], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = expected.min(0).values < min_expected
    if small.any():  # pool the rare categories into one
        table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], 1)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def goodness_of_fit_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square test of ``samples`` (token ids) against ``probs`` [V]."""
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def tensors(n: int, temperature: float, top_k: int = V, seed0: int = 0) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.full((n,), temperature),
        top_ks=torch.full((n,), top_k),
        top_ps=torch.ones(n),
        seeds=torch.arange(seed0, seed0 + n),
        steps=torch.zeros(n, dtype=torch.int64),
        needs_filter=top_k < V,
        all_greedy=temperature == 0,
    )


def target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits / temperature
    scaled[scaled < scaled.topk(top_k).values[-1]] = float("-inf")
    return torch.softmax(scaled, -1)


@pytest.mark.parametrize(
    "temperature, top_k, draft_kind",
    [(1.0, V, "dirichlet"), (0.7, V, "dirichlet"), (1.0, 3, "dirichlet"), (1.0, V, "point")],
)
def test_rejection_sampling_emits_the_target_distribution(temperature, top_k, draft_kind):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(V, generator=gen) * 1.5
    p = target(logits.clone(), temperature, top_k)
    if draft_kind == "point":
        q = torch.zeros(V)
        q[int(torch.argsort(p)[1])] = 1.0  # an unlikely token, drafted every time
    else:
        q = torch.distributions.Dirichlet(torch.ones(V)).sample()
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)
    st = tensors(N, temperature, top_k)
    st.draft = DraftDistributions(drafts, q.expand(N, V).contiguous())
    out = sample(logits.expand(N, V).contiguous(), st)
    assert goodness_of_fit_p(out.tokens, p) > ALPHA
    accepted = (out.tokens == drafts).double().mean()
    assert abs(accepted - torch.minimum(p, q).sum()) < 4 * (0.25 / N) ** 0.5  # P(accept)
    # the plain sampler draws the same law, and seeds make every draw reproducible
    st.draft = None
    plain = sample(logits.expand(N, V).contiguous(), st).tokens
    assert chi_square_p([Counter(out.tokens.tolist()), Counter(plain.tolist())]) > ALPHA
    st.draft = DraftDistributions(drafts, q.expand(N, V).contiguous())
    assert torch.equal(sample(logits.expand(N, V).contiguous(), st).tokens, out.tokens)


def test_greedy_rows_accept_only_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0, 0.0, 0.5]] * 3)
    st = tensors(3, 0.0)
    q = torch.full((3, V), 1.0 / V)
    st.draft = DraftDistributions(torch.tensor([1, 2, -1]), q)
    assert sample(logits, st).tokens.tolist() == [1, 1, 1]


def test_accepted_lengths_and_emitted_tokens():
    # three sequences: 2 drafts (both drawn), 3 drafts (the second missed), no draft
    drafts = [[7, 8], [4, 5, 6], []]
    rows = torch.tensor([7, 8, 9, 4, 1, 6, 2, 3])
    assert accepted_lengths(rows, drafts) == [2, 1, 0]
    assert emitted_tokens(rows, drafts) == [[7, 8, 9], [4, 1], [3]]
    assert emitted_tokens(torch.tensor([5]), [[]]) == [[5]]


def test_a_draft_position_shows_the_sequence_after_its_drafts():
    sp = SamplingParams(max_tokens=10)
    seq = Sequence("r", [1, 2, 3], sp, seed=9, arrival=0.0)
    seq.token_ids += [4]
    seq.spec_token_ids = [5, 6]
    row = DraftPosition(seq, 2)
    assert (row.num_output_tokens, row.output_token_ids) == (3, [4, 5, 6])
    assert row.token_ids == [1, 2, 3, 4, 5, 6] and row.seed == 9 and row.sampling is sp


def test_trim_frees_blocks_that_hold_only_rolled_back_positions():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("r", list(range(10, 17)), SamplingParams(), 0, 0.0)  # 7 tokens
    bm.allocate(seq, 12)  # a verification row reaching position 11: three blocks
    seq.num_computed_tokens = 8  # positions 8.. rejected
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    taken = bm._take_free_block()
    assert taken not in seq.block_table  # the freed block is the first one reused
    seq.num_computed_tokens = 5
    bm.trim(seq)
    assert len(seq.block_table) == 2  # a block with computed tokens stays
