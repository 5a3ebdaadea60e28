"""n choices from one prefill (services/engine/sequence_group.py), on the real engine: every
choice equals what HF (greedy) or a single n=1 run with that choice's seed generates, whether the
prompt was computed here or its KV pulled from a prefill engine, wherever the last prompt token
sits in its block, under preemption, and when a choice cannot be forked at once; aborts of one
choice or all of them at any point, and every block free afterwards."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepOutput
from pdserve.shared.sampling import SamplingParams, choice_seed
from tests.engine.test_engine_lifecycle import all_free, pull
from tests.engine_support import make_engine, random_prompts, step_outputs
from tests.oracle import hf_greedy

SEEDED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7, n=4)


@pytest.fixture(scope="module")
def reference(llama_dir) -> LLMEngine:
    """n=1 runs, the oracle for forked choices (no prefix cache: every KV computed afresh)."""
    return make_engine(
        llama_dir, prefix_cache=False, num_kv_blocks=512, max_num_batched_tokens=1024
    )


@pytest.fixture(scope="module")
def prefill(llama_dir) -> LLMEngine:
    return make_engine(llama_dir, prefill_only=True)


def singles(reference: LLMEngine, prompt: list[int], sp: SamplingParams) -> list[list[int]]:
    """Each choice of ``sp`` as its own n=1 request with that choice's seed."""
    one = [replace(sp, n=1, seed=choice_seed(sp.seed, i)) for i in range(sp.n)]
    return reference.generate([prompt] * sp.n, one)


class Collector:
    """A request's outputs by choice, checking request_finished as they come."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.request_finished = 0
        self.after_finished = 0

    def take(self, outs: list[StepOutput]) -> None:
        for out in outs:
            self.after_finished += self.request_finished
            assert self.reasons[out.index] is None, f"choice {out.index} spoke after its end"
            self.tokens[out.index] += out.new_token_ids
            self.reasons[out.index] = out.finish_reason
            self.request_finished += out.request_finished

    def drain(self, engine: LLMEngine) -> Collector:
        while engine.has_unfinished():
            self.take(step_outputs(engine))
        return self


def test_greedy_choices_all_equal_hf(llama_dir) -> None:
    prompts = random_prompts(2, seed=31, max_len=40)
    expected = hf_greedy(llama_dir, prompts, 8)
    engine = make_engine(llama_dir)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3)
    assert engine.generate_choices(prompts, sp) == [[e] * 3 for e in expected]
    assert all_free(engine)


def test_seeded_choices_differ_reproduce_and_match_single_runs(llama_dir, reference) -> None:
    prompt = random_prompts(1, seed=32, max_len=40)[0] + list(range(50, 70))
    engine = make_engine(llama_dir)
    (choices,) = engine.generate_choices([prompt], SEEDED)
    assert len({tuple(c) for c in choices}) == SEEDED.n  # every choice samples its own
    assert engine.generate_choices([prompt], SEEDED) == [choices]  # the seed reproduces all
    assert choices == singles(reference, prompt, SEEDED)  # forked KV == KV computed afresh
    assert all_free(engine)


def test_children_share_full_prompt_blocks_and_copy_the_last(llama_dir) -> None:
    engine = make_engine(llama_dir)
    prompt = list(range(5, 45))  # 40 tokens: blocks 0 and 1 full, the last token in block 2
    engine.add_request("r", prompt, SEEDED)
    outs = step_outputs(engine)  # the whole prefill, choice 0's first token, then the fork
    assert [(o.index, len(o.new_token_ids)) for o in outs] == [(0, 1)]
    seqs = [engine.scheduler.seqs["r"]] + [engine.scheduler.seqs[f"r#{i}"] for i in range(1, 4)]
    parent = seqs[0].block_table
    bm = engine.block_manager
    assert [bm.ref_counts[b] for b in parent[:2]] == [4, 4]
    lasts = {s.block_table[2] for s in seqs}
    assert len(lasts) == 4 and all(bm.ref_counts[b] == 1 for b in lasts)
    assert all(s.block_table[:2] == parent[:2] for s in seqs)
    for child in seqs[1:]:  # the copy holds the prompt's KV (slots 32..39) of block 2
        copy = engine.kv_cache[child.block_table[2], :, :, :8]
        assert child.num_computed_tokens == 39
        assert bool((copy == engine.kv_cache[parent[2], :, :, :8]).all())
    assert engine.stats().running == 4 and engine.stats().used_blocks == 3 + 3
    Collector(4).drain(engine)
    assert all_free(engine)


def test_last_prompt_token_at_every_position_of_a_block(llama_dir, reference) -> None:
    """Prompts of 15..33 tokens put the last one at every slot of a block (block size 16),
    first and last slot included: the block each child copies."""
    base = [(7 * i) % 370 + 5 for i in range(33)]
    prompts = [base[:length] for length in range(15, 34)]
    sp = replace(SEEDED, n=3, max_tokens=5)
    # room for every choice's copy at once: no choice waits in the queue here
    engine = make_engine(llama_dir, num_kv_blocks=256, max_num_batched_tokens=1024)
    got = engine.generate_choices(prompts, sp)
    one = [replace(sp, n=1, seed=choice_seed(sp.seed, i)) for i in range(3)]
    want = reference.generate([p for p in prompts for _ in range(3)], one * len(prompts))
    assert got == [want[3 * k : 3 * k + 3] for k in range(len(prompts))]
    assert all_free(engine)


def test_pulled_kv_forks_on_kv_ready(llama_dir, prefill, reference) -> None:
    prompt = random_prompts(1, seed=34, max_len=40)[0] + [9] * 17
    sp = SEEDED
    prefill.add_request("a", prompt, sp)
    (first,) = step_outputs(prefill)  # a prefill engine never forks: it parks choice 0
    assert first.index == 0 and first.finish_reason is None and not first.request_finished
    assert first.num_kv_tokens == len(prompt) and prefill.stats().running == 0
    decode = make_engine(llama_dir)
    decode.add_request("a", prompt, sp, first.new_token_ids, remote_kv=True)
    result = decode.step()
    assert result.outputs == [] and decode.stats().used_blocks == -(-len(prompt) // 16)
    pull(decode, result, prefill, first.kv_block_ids)
    prefill.release("a")
    got = Collector(sp.n)
    got.take([first])
    got.drain(decode)
    assert got.tokens == singles(reference, prompt, sp)
    assert got.request_finished == 1 and got.after_finished == 0
    assert prefill.step() is None and all_free(prefill) and all_free(decode)


def test_choice_zero_ended_by_its_first_token_still_carries_the_prompt(
    llama_dir, prefill, reference
) -> None:
    """A first token that ends choice 0 (here a stop token) parks its KV anyway on the prefill
    engine: the decode engine forks the other choices from it, and choice 0 says no more."""
    prompt = random_prompts(1, seed=35, max_len=30)[0]
    probe = singles(reference, prompt, SEEDED)
    sp = replace(SEEDED, stop_token_ids=[probe[0][0]])
    prefill.add_request("s", prompt, sp)
    (first,) = step_outputs(prefill)
    assert first.finish_reason == "stop" and first.kv_block_ids and not first.request_finished
    decode = make_engine(llama_dir)
    decode.add_request("s", prompt, sp, first.new_token_ids, remote_kv=True)
    result = decode.step()
    assert [(o.index, o.finish_reason, o.request_finished) for o in result.outputs] == [
        (0, "stop", False)
    ]
    pull(decode, result, prefill, first.kv_block_ids)
    prefill.release("s")
    got = Collector(sp.n)
    got.take([first])
    got.drain(decode)
    assert got.tokens == singles(reference, prompt, sp) and got.tokens[0] == probe[0][:1]
    assert got.request_finished == 1 and got.after_finished == 0
    assert prefill.step() is None and all_free(prefill) and all_free(decode)


def test_abort_one_choice_after_the_fork(llama_dir, reference) -> None:
    prompt = random_prompts(1, seed=36, max_len=40)[0]
    engine = make_engine(llama_dir)
    engine.add_request("r", prompt, SEEDED)
    got = Collector(SEEDED.n)
    got.take(step_outputs(engine))  # prefill and fork
    got.take(step_outputs(engine))  # every choice has a token now
    engine.abort("r", 2)
    engine.abort("r", 7)  # no such choice: ignored
    got.drain(engine)
    want = singles(reference, prompt, SEEDED)
    assert len(got.tokens[2]) == 1 and got.reasons[2] is None  # aborted: no more output
    assert [got.tokens[i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    assert got.request_finished == 1 and got.after_finished == 0
    assert all_free(engine) and not engine.scheduler.seqs and not engine.scheduler.requests


def test_abort_choices_before_the_fork(llama_dir, prefill, reference) -> None:
    """Mid-pull: one choice still to fork is aborted, and choice 0 too, which still carries the
    prompt's KV: the pull lands, the remaining choices fork from it, choice 0 leaves quietly."""
    prompt = random_prompts(1, seed=37, max_len=40)[0]
    prefill.add_request("p", prompt, SEEDED)
    (first,) = step_outputs(prefill)
    decode = make_engine(llama_dir)
    decode.add_request("p", prompt, SEEDED, first.new_token_ids, remote_kv=True)
    result = decode.step()
    decode.abort("p", 1)
    decode.abort("p", 0)
    assert decode.step() is None
    pull(decode, result, prefill, first.kv_block_ids)
    prefill.release("p")
    got = Collector(SEEDED.n).drain(decode)
    want = singles(reference, prompt, SEEDED)
    assert got.tokens == [[], [], want[2], want[3]]
    assert got.request_finished == 1 and got.after_finished == 0
    assert prefill.step() is None and all_free(prefill) and all_free(decode)


def test_choice_zero_aborted_before_a_local_fork_says_nothing(llama_dir, reference) -> None:
    prompt = random_prompts(1, seed=38, max_len=40)[0] + list(range(60, 100))
    engine = make_engine(llama_dir, max_num_batched_tokens=32)  # a prefill in several chunks
    engine.add_request("r", prompt, SEEDED)
    assert step_outputs(engine) == []  # the first chunk
    engine.abort("r", 0)
    got = Collector(SEEDED.n).drain(engine)
    want = singles(reference, prompt, SEEDED)
    assert got.tokens == [[]] + want[1:]
    assert got.request_finished == 1 and all_free(engine)


@pytest.mark.parametrize("when", ["queued", "mid-prefill", "after-fork", "later"])
def test_abort_all_choices_frees_everything(llama_dir, when) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=32)
    prompt = random_prompts(1, seed=39, max_len=40)[0] + list(range(60, 100))
    engine.add_request("r", prompt, SEEDED)
    steps = {"queued": 0, "mid-prefill": 1, "after-fork": 3, "later": 5}[when]
    for _ in range(steps):
        step_outputs(engine)
    assert (engine.stats().running == SEEDED.n) == (when in ("after-fork", "later"))
    engine.abort("r")
    assert step_outputs(engine) == [] and not engine.has_unfinished()  # aborted: nothing said
    assert all_free(engine) and not engine.scheduler.seqs and not engine.scheduler.requests
    assert engine.block_manager.ref_counts == [0] * engine.num_blocks


def test_abort_all_mid_pull_frees_the_blocks_when_the_pull_answers(llama_dir) -> None:
    decode = make_engine(llama_dir, num_kv_blocks=8)
    decode.add_request("c", [5] * 40, SEEDED, [6], remote_kv=True)
    assert decode.step().pulls
    decode.abort("c")
    assert decode.step() is None and decode.stats().free_blocks == 8 - 3
    decode.kv_ready("c")
    assert decode.step() is None  # no fork, nothing said
    assert all_free(decode) and not decode.scheduler.requests


def test_a_failed_pull_ends_every_choice(llama_dir) -> None:
    decode = make_engine(llama_dir)
    decode.add_request("f", [5] * 40, SEEDED, [6], remote_kv=True)
    decode.kv_failed(decode.step().pulls[0].bus_id, "no lease")
    (out,) = step_outputs(decode)
    assert (out.index, out.finish_reason, out.request_finished) == (0, "error", True)
    assert all_free(decode) and not decode.has_unfinished()


def test_a_failed_pull_recomputed_here_still_forks(llama_dir, reference) -> None:
    prompt = random_prompts(1, seed=40, max_len=40)[0]
    want = singles(reference, prompt, SEEDED)
    decode = make_engine(llama_dir, kv_failure_policy="recompute")
    decode.add_request("f", prompt, SEEDED, want[0][:1], remote_kv=True)
    decode.kv_failed(decode.step().pulls[0].bus_id, "no lease")
    got = Collector(SEEDED.n)
    got.tokens[0] = want[0][:1]
    assert got.drain(decode).tokens == want and all_free(decode)


def test_preempted_choices_recompute_the_same_tokens(llama_dir, reference) -> None:
    prompts = random_prompts(3, seed=41, max_len=30)
    sp = replace(SEEDED, max_tokens=24)
    engine = make_engine(llama_dir, num_kv_blocks=10, max_model_len=64)
    got = engine.generate_choices(prompts, sp)
    assert engine.stats().preemptions > 0
    assert got == [singles(reference, p, sp) for p in prompts]
    assert all_free(engine)


def test_a_choice_without_a_block_or_slot_waits_in_the_queue(llama_dir, reference) -> None:
    """No free block for a child's copy (or no sequence slot) at the fork: it waits at the front
    of the queue and is computed like a preempted sequence, from the prefix cache if it can."""
    prompt = random_prompts(1, seed=42, max_len=1)[0] * 20  # 20 tokens: 2 blocks, the last one
    sp = replace(SEEDED, n=3, max_tokens=8)  # holds the whole output too: 28 <= 32 tokens
    want = singles(reference, prompt, sp)
    engine = make_engine(llama_dir, num_kv_blocks=2)
    engine.add_request("r", prompt, sp)
    got = Collector(sp.n)
    got.take(step_outputs(engine))
    assert engine.stats().running == 1 and engine.stats().waiting == 2
    got.drain(engine)
    assert got.tokens == want and got.request_finished == 1 and all_free(engine)
    assert engine.stats().prefix_hits >= 2  # the queued choices reused the prompt's full block
    slots = make_engine(llama_dir, max_num_seqs=2)
    assert slots.generate_choices([prompt], sp) == [want] and all_free(slots)


def test_n1_request_finished_exactly_with_its_finish_reason(llama_dir) -> None:
    engine = make_engine(llama_dir)
    for i, prompt in enumerate(random_prompts(3, seed=43)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3 + i))
    outs = []
    while engine.has_unfinished():
        outs += step_outputs(engine)
    assert all(o.request_finished == (o.finish_reason is not None) for o in outs)
    assert sum(o.request_finished for o in outs) == 3


def test_choice_seeds() -> None:
    bases = (0, 7, 8, -(2**63 - 1), 2**63 - 1)
    assert [choice_seed(s, 0) for s in bases] == list(bases)  # choice 0: the request's seed
    mixed = [choice_seed(s, i) for s in bases for i in range(1, 16)]
    assert len(set(mixed) | set(bases)) == len(mixed) + len(bases)
    assert all(0 <= s < 2**63 for s in mixed)  # an int64, and a valid n=1 request's seed
