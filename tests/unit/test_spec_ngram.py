"""Speculative decoding's host side: n-gram lookup, the adaptive draft budget, which sequences
draft and how much, and the start-up checks of the speculative options (the CLI's one-line
report of them, in a process of its own: tests/integration/test_cli_startup_errors.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.spec import adaptive
from pdserve.services.engine.spec.adaptive import MAX_PAUSE, DraftBudget, best_length
from pdserve.services.engine.spec.cost import DraftCost
from pdserve.services.engine.spec.ngram import NgramProposer, TokenArray, find_draft
from pdserve.services.engine.spec.proposer import Proposal, Proposer
from pdserve.services.engine.spec.speculator import Speculator
from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import GuidedDecoding, SamplingParams


def draft(tokens: list[int], min_n: int = 1, max_n: int = 4, k: int = 4) -> list[int]:
    return find_draft(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_the_tokens_after_an_earlier_match_of_the_suffix_are_the_draft() -> None:
    #        0  1  2  3  4  5  6  7  8     suffix [2, 3] matched at 1..2
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3]
    assert draft(tokens) == [4, 5, 6, 9]
    assert draft(tokens, k=2) == [4, 5]
    assert draft(tokens, min_n=3) == []  # [9, 2, 3] occurs nowhere else
    assert draft([1, 2, 3]) == []  # the suffix alone matches only itself
    assert draft([7]) == []


def test_the_longest_match_wins_then_the_longest_continuation_then_the_latest() -> None:
    # suffix [5, 6, 7]: [6, 7] occurs at 1..2 (then 8), [5, 6, 7] at 5..7 (then 9)
    tokens = [0, 6, 7, 8, 1, 5, 6, 7, 9, 3, 5, 6, 7]
    assert draft(tokens, k=1) == [9]
    # a loop: every earlier period matches fully; the latest has one token after it, an
    # earlier one has a whole draft's worth
    loop = [4, 1, 2, 3] * 3 + [4, 1, 2, 3]
    assert draft(loop, k=4) == [4, 1, 2, 3]
    # equal matches and continuations: the latest one
    assert draft([1, 2, 7, 0, 1, 2, 8, 0, 1, 2], min_n=2, k=1) == [8]


def test_token_array_follows_a_growing_sequence() -> None:
    array = TokenArray()
    tokens = list(range(50))
    assert array.sync(tokens).tolist() == tokens
    tokens += list(range(50, 300))  # past the first capacity
    assert array.sync(tokens).tolist() == tokens
    assert array.sync(tokens).tolist() == tokens  # nothing new


def seq(tokens: list[int], num_prompt: int | None = None, **sampling) -> Sequence:
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 100, **sampling})
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    s = Sequence("r", tokens[:num_prompt], sp, 0, 0.0)
    s.token_ids.extend(tokens[num_prompt:])
    s.num_computed_tokens = s.num_tokens - 1  # decoding: the last token is not computed yet
    return s


def test_ngram_proposer_drafts_per_sequence() -> None:
    proposer = NgramProposer(2, 3)
    a = seq([1, 2, 3, 4, 1, 2])
    b = seq([9, 8, 7])
    out = proposer.propose([a, b], [2, 4])
    assert out[0] == Proposal([3, 4]) and out[1] is None
    a.token_ids += [3]  # the sequence grew: the proposer's copy follows
    assert proposer.propose([a], [4])[0] == Proposal([4, 1, 2, 3])
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_draft_length_weighs_acceptance_against_cost() -> None:
    # free drafts: always K, unless nothing is ever accepted
    assert best_length([0.3] * 4, 0.0) == 4 and best_length([0.0] * 4, 0.0) == 0
    # a CPU-like cost (a 5-token row ~1.5x-2.4x a 1-token one): long drafts only for copying
    assert best_length([0.95] * 4, 0.35) == 4
    assert best_length([0.8] * 4, 0.35) == 3
    assert best_length([0.5] * 4, 0.35) == 1
    assert best_length([0.3] * 4, 0.35) == 0  # 1.3 tokens for 1.35 steps: not worth it
    assert best_length([0.9] * 8, 1.0) == 0  # a compute-bound batch: no draft pays
    # bursty acceptance: often wrong at once, but right all along once the first one is
    assert best_length([0.6, 0.95, 0.95, 0.95], 0.15) == 4
    assert best_length([0.6] * 4, 0.15) == 2


def test_rates_follow_each_position_given_the_one_before() -> None:
    budget = DraftBudget(max_tokens=3, rates=[0.8] * 3)
    budget.update(3, 1)  # position 0 accepted, 1 rejected, 2 never reached
    assert budget.rates == pytest.approx([0.86, 0.56, 0.8])
    budget.update(2, 2)  # both accepted, position 2 not drafted
    assert budget.rates == pytest.approx([0.902, 0.692, 0.8])


def test_budget_shrinks_pauses_and_recovers() -> None:
    budget = DraftBudget(max_tokens=4, rates=[0.8] * 4)
    cost = 0.35
    assert budget.limit(cost) == 3  # at an acceptance estimate of 0.8
    limits = []
    while (k := budget.limit(cost)) > 0:  # every draft rejected
        limits.append(k)
        budget.update(k, 0)
    assert limits[0] == 3 and sorted(limits, reverse=True) == limits
    pauses = []
    for _ in range(8):
        skipped = 0 if pauses else 1  # (the first pause began as the loop above ended)
        while (k := budget.limit(cost)) == 0:
            skipped += 1
        assert k == 1  # after a pause: a one-token probe
        pauses.append(skipped)
        budget.update(1, 0)
    assert pauses == [1, 2, 4, 8, 16, 32, MAX_PAUSE, MAX_PAUSE]
    # the text starts repeating: every probe and draft is accepted, and K comes back within
    # a pause or two
    steps, drafted = 0, []
    while not drafted or drafted[-1] < 4:
        steps += 1
        if k := budget.limit(cost):
            budget.update(k, k)
            drafted.append(k)
    assert steps < 2 * MAX_PAUSE + 10 and budget.next_pause == 1
    assert drafted == sorted(drafted)


def test_draft_cost_is_measured_on_the_engine_s_steps() -> None:
    cost = DraftCost()
    assert cost.relative(1) == 0.0  # nothing measured: drafts are taken as free
    for i in range(200):  # a step of T tokens takes 50 ms + 10 ms per token
        t = 1 + i % 5
        cost.observe(t, 0.05 + 0.01 * t * (1.02 if i % 2 else 0.98))
    assert cost.relative(1) == pytest.approx(0.01 / 0.06, rel=0.05)
    assert cost.relative(8) == pytest.approx(0.01 / (0.05 / 8 + 0.01), rel=0.05)
    for _ in range(20):
        cost.observe(3, 5.0)  # a machine stalled by something else: clipped, not believed
    assert cost.relative(1) < 0.5
    assert DraftCost(fixed=0.2).relative(8) == 0.2


class Recorder(Proposer):
    """A proposer that drafts ``limit`` copies of token 5 and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[str], list[int]]] = []

    def propose(self, seqs, max_tokens):
        self.asked.append(([s.bus_id for s in seqs], list(max_tokens)))
        return [Proposal([5] * k) for k in max_tokens]


def named(name: str, s: Sequence) -> Sequence:
    s.bus_id = s.seq_id = name
    return s


def test_who_drafts_and_how_much(monkeypatch) -> None:
    monkeypatch.setattr(adaptive, "INITIAL_RATE", 0.8)  # a confident prior: long first drafts
    recorder = Recorder()
    speculator = Speculator(recorder, num_tokens=4, cost=DraftCost(0.35), max_model_len=30)
    base = list(range(10, 20))
    running = [
        named("plain", seq(base)),
        named("near-max-tokens", seq(base + [1, 2], num_prompt=10, max_tokens=4)),
        named("last-token", seq(base + [1], num_prompt=10, max_tokens=2)),
        named("near-context", seq(list(range(27)))),
        named("opted-out", seq(base, speculate=False)),
        named("guided", seq(base, guided=GuidedDecoding("regex", "[a-z]+"))),
        named("prefilling", seq(base)),
    ]
    running[-1].num_computed_tokens = 3
    speculator.propose(running)
    # the budget allows 3 (initial acceptance, cost 0.35); 2 of 4 tokens out: one more step
    # may draft 1 (it emits 2); at max_tokens - 1, none; 27 of 30 positions: 3 fill the context
    assert recorder.asked == [(["plain", "near-max-tokens", "near-context"], [3, 1, 3])]
    assert [len(s.spec_token_ids) for s in running] == [3, 1, 0, 3, 0, 0, 0]
    speculator.verified(running[0], 3, 1)
    speculator.verified(running[0], 3, 0)
    assert speculator.counters.drafts == 2 and speculator.counters.accepted_per_pos == [1, 0, 0, 0]
    speculator.propose(running)  # every draft is made afresh each step: "plain" drafts less
    assert [len(s.spec_token_ids) for s in running] == [1, 1, 0, 3, 0, 0, 0]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_speculative_tokens": 0}, "--num-speculative-tokens must be at least 1, got 0"),
        ({"ngram_min": 0}, "--ngram-min must be at least 1, got 0"),
        ({"ngram_min": 5, "ngram_max": 3}, "--ngram-min (5) exceeds --ngram-max (3)"),
        ({"spec_token_cost": -2.0}, "--spec-token-cost must be -1 (measured) or >= 0, got -2.0"),
        ({"speculative": "eagle"}, "--speculative must be one of off, ngram, draft, got 'eagle'"),
        ({"speculative": "draft"}, "--speculative draft needs --draft-model PATH"),
        ({"draft_model": "x"}, "--draft-model is only used with --speculative draft"),
    ],
)
def test_bad_speculative_options_fail_at_start_up(options, message) -> None:
    with pytest.raises(StartupError) as err:
        EngineConfig(**{"speculative": "ngram", **options})
    assert message in str(err.value) and "\n" not in str(err.value)
