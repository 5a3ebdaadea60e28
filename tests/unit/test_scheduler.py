"""The scheduler's status machine on its own: no model, no checkpoint, a fake runner.

As vLLM's ``create_scheduler`` does, each test builds a ``Scheduler`` over a small
``BlockManager`` and drives a step by hand: ``schedule()``, then ``update_from_output`` with
what a runner would have produced (``fake_run``: every row whose last token was computed
samples what the test says). The statuses and their transitions are drawn in
``services/engine/sequence.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.commands import AddRequest, BlockHoldRefused
from pdserve.services.engine.outputs import RunnerOutput, ScheduledBatch, StepOutput, StepStats
from pdserve.services.engine.scheduler import Scheduler
from pdserve.services.engine.sequence import Sequence, SequenceStatus
from pdserve.shared.sampling import SamplingParams

WAITING = SequenceStatus.WAITING
WAITING_FOR_REMOTE_KV = SequenceStatus.WAITING_FOR_REMOTE_KV
RUNNING = SequenceStatus.RUNNING
PREEMPTED = SequenceStatus.PREEMPTED
PREFILLED = SequenceStatus.PREFILLED
FINISHED = SequenceStatus.FINISHED

EOS = 1
TOKEN = 7  # what the fake runner samples unless told otherwise: never EOS
LONG = SamplingParams(max_tokens=40, ignore_eos=True)

Sample = Callable[[Sequence], list[int]]


def create_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    prefix_cache: bool = True,
    **kwargs,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix_cache)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, (EOS,), 64, **kwargs)


def add(
    sch: Scheduler,
    bus_id: str,
    prompt: list[int],
    sp: SamplingParams = LONG,
    output: tuple[int, ...] = (),
    remote_kv: bool = False,
) -> StepOutput | None:
    return sch.add_request(AddRequest(bus_id, prompt, sp, output, remote_kv))


def fake_run(batch: ScheduledBatch, sample: Sample) -> RunnerOutput:
    """A runner's output without a model: each row whose last token (its draft aside) is
    computed samples ``sample(seq)`` - for a draft, its accepted tokens and the one after."""
    run = RunnerOutput()
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        draft = len(seq.spec_token_ids)
        if seq.num_computed_tokens + n - draft == seq.num_tokens:
            run.sampled[i] = sample(seq)
            if draft:
                run.drafted[i] = draft
    return run


def step(
    sch: Scheduler, sample: Sample = lambda seq: [TOKEN]
) -> tuple[ScheduledBatch | None, list[StepOutput], StepStats]:
    batch = sch.schedule()
    if batch is None or not batch.seqs:
        return batch, [], StepStats()
    outputs, stats = sch.update_from_output(batch, fake_run(batch, sample))
    return batch, outputs, stats


def said(outputs: list[StepOutput]) -> list[tuple[str, list[int], str | None]]:
    return [(o.bus_id, o.new_token_ids, o.finish_reason) for o in outputs]


def all_free(sch: Scheduler) -> bool:
    bm = sch.bm
    return (
        bm.num_free_blocks == bm.num_blocks
        and not sch.has_work()
        and not sch.seqs
        and not sch.requests
    )


def test_waiting_to_running_to_finished_by_length() -> None:
    sch = create_scheduler()
    assert add(sch, "a", [3, 4, 5, 6, 8], SamplingParams(max_tokens=3)) is None
    seq = sch.seqs["a"]
    assert seq.status is WAITING and list(sch.waiting) == [seq]
    batch, outs, stats = step(sch)
    assert batch.seqs == [seq] and batch.num_new_tokens == [5] and batch.num_decodes == 0
    assert stats.prefill_seqs == {"a": 0} and stats.num_tokens == 5
    assert seq.status is RUNNING and sch.running == [seq] and not sch.waiting
    assert said(outs) == [("a", [TOKEN], None)] and seq.num_computed_tokens == 5
    batch, outs, _ = step(sch)
    assert batch.num_new_tokens == [1] and batch.num_decodes == 1
    assert said(outs) == [("a", [TOKEN], None)]
    _, outs, _ = step(sch)
    assert said(outs) == [("a", [TOKEN], "length")] and outs[0].request_finished
    assert seq.status is FINISHED and seq.finish_reason == "length" and all_free(sch)


def test_a_stop_token_or_eos_finishes_unless_eos_is_ignored() -> None:
    sch = create_scheduler()
    add(sch, "stop", [3, 4], SamplingParams(max_tokens=9, stop_token_ids=[TOKEN]))
    add(sch, "eos", [3, 4], SamplingParams(max_tokens=9))
    add(sch, "ignored", [3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    _, outs, _ = step(sch, lambda seq: [TOKEN if seq.bus_id == "stop" else EOS])
    assert said(outs) == [
        ("stop", [TOKEN], "stop"),
        ("eos", [EOS], "stop"),
        ("ignored", [EOS], None),
    ]
    _, outs, _ = step(sch, lambda seq: [EOS])
    assert said(outs) == [("ignored", [EOS], "length")] and all_free(sch)


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    sch = create_scheduler(max_num_batched_tokens=4)
    add(sch, "long", list(range(10, 20)), SamplingParams(max_tokens=2))
    seq = sch.seqs["long"]
    for computed in (4, 8):  # chunks that are not the last sample nothing
        batch, outs, stats = step(sch)
        assert batch.num_new_tokens == [4] and outs == [] and stats.prefill_seqs == {"long": 0}
        assert seq.status is RUNNING and seq.num_computed_tokens == computed
    batch, outs, _ = step(sch)
    assert batch.num_new_tokens == [2] and said(outs) == [("long", [TOKEN], None)]
    # a decode runs first, and a newcomer's prompt takes what is left of the budget
    add(sch, "next", list(range(30, 40)), SamplingParams(max_tokens=1))
    batch, _, _ = step(sch)
    assert [s.bus_id for s in batch.seqs] == ["long", "next"] and batch.num_new_tokens == [1, 3]


def test_the_newest_sequence_is_preempted_and_recomputed_later() -> None:
    sch = create_scheduler(num_blocks=4, prefix_cache=False)
    six = SamplingParams(max_tokens=6, ignore_eos=True)
    add(sch, "a", [3, 4, 5, 6], six)
    add(sch, "b", [8, 9, 10, 11], six)
    a, b = sch.seqs["a"], sch.seqs["b"]
    for _ in range(5):  # both fill their second block
        _, outs, _ = step(sch)
        assert [o.bus_id for o in outs] == ["a", "b"]
    assert sch.bm.num_free_blocks == 0
    batch = sch.schedule()  # a needs a third block: b, the newest, gives its blocks back
    assert batch.seqs == [a] and sch.num_preemptions == 1
    assert b.status is PREEMPTED and list(sch.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_output_tokens == 5
    outs, _ = sch.update_from_output(batch, fake_run(batch, lambda seq: [TOKEN]))
    assert said(outs) == [("a", [TOKEN], "length")]
    batch, outs, _ = step(sch)  # b comes back: its prompt and outputs computed again
    assert batch.seqs == [b] and batch.num_new_tokens == [9] and b.status is FINISHED
    assert said(outs) == [("b", [TOKEN], "length")] and all_free(sch)


def test_abort_ends_a_request_or_one_choice_wherever_it_is() -> None:
    sch = create_scheduler()
    add(sch, "queued", [3, 4, 5])
    queued = sch.seqs["queued"]
    sch.abort("queued")
    assert queued.status is FINISHED and queued.finish_reason == "abort" and all_free(sch)
    sch.abort("unknown")  # ignored
    add(sch, "running", [3, 4, 5])
    step(sch)
    sch.abort("running")
    assert step(sch)[0] is None and all_free(sch)
    # one choice of two: the other goes on; aborted choices say nothing
    add(sch, "n2", [3, 4, 5, 6, 8], SamplingParams(n=2, seed=1, max_tokens=3))
    _, outs, _ = step(sch)
    assert said(outs) == [("n2", [TOKEN], None)] and set(sch.seqs) == {"n2", "n2#1"}
    sch.abort("n2", 1)
    assert set(sch.seqs) == {"n2"} and sch.requests["n2"].unfinished == {0}
    _, outs, _ = step(sch)
    assert [(o.index, o.finish_reason) for o in outs] == [(0, None)]
    _, outs, _ = step(sch)
    assert outs[0].request_finished and all_free(sch)


def test_choices_fork_after_the_prefill_with_a_copy_of_the_last_prompt_block() -> None:
    sch = create_scheduler()
    add(sch, "r", [3, 4, 5, 6, 8], SamplingParams(n=3, seed=1, max_tokens=2))
    parent = sch.seqs["r"]
    step(sch)
    kids = [sch.seqs["r#1"], sch.seqs["r#2"]]
    assert all(k.status is RUNNING and k.num_computed_tokens == 4 for k in kids)
    assert [k.block_table[0] for k in kids] == [parent.block_table[0]] * 2  # shared
    assert sch.block_copies == [(parent.block_table[1], k.block_table[1]) for k in kids]
    sch.block_copies.clear()  # what the engine does once it has copied them
    batch, outs, _ = step(sch)  # each child recomputes the last prompt token, samples its own
    assert batch.num_new_tokens == [1, 1, 1]
    assert [(o.index, o.finish_reason) for o in outs] == [(0, "length"), (1, None), (2, None)]
    _, outs, _ = step(sch)
    assert [o.request_finished for o in outs] == [False, True] and all_free(sch)


def test_remote_kv_is_reserved_then_pulled_then_run() -> None:
    sch = create_scheduler()
    add(sch, "p", list(range(10, 18)), SamplingParams(max_tokens=3), (9,), remote_kv=True)
    seq = sch.seqs["p"]
    batch = sch.schedule()
    assert batch.seqs == [] and batch.pulls == [seq] and batch.num_tokens == 0
    assert seq.status is WAITING_FOR_REMOTE_KV and sch.pulling == {"p": seq}
    assert len(seq.block_table) == 2 and sch.bm.num_free_blocks == 14
    assert sch.schedule() is None  # nothing moves until the pull answers
    sch.kv_ready("p")
    assert seq.status is RUNNING and not sch.pulling and seq.num_computed_tokens == 8
    batch, outs, _ = step(sch)  # the first token (from the prefill worker) is decoded here
    assert batch.num_new_tokens == [1] and said(outs) == [("p", [TOKEN], None)]
    sch.kv_ready("p")  # a second answer is ignored (and logged)
    assert seq.status is RUNNING


def test_a_failed_pull_errors_or_recomputes_by_policy() -> None:
    sch = create_scheduler()
    add(sch, "f", list(range(10, 18)), LONG, (9,), remote_kv=True)
    sch.schedule()
    out = sch.kv_failed("f", "boom")
    assert said([out]) == [("f", [], "error")] and out.error == "KV transfer failed: boom"
    assert out.request_finished and all_free(sch)

    sch = create_scheduler(kv_failure_policy="recompute")
    add(sch, "r", list(range(10, 18)), SamplingParams(max_tokens=2), (9,), remote_kv=True)
    seq = sch.seqs["r"]
    sch.schedule()
    assert sch.kv_failed("r", "boom") is None
    assert seq.status is WAITING and list(sch.waiting) == [seq] and not seq.remote_kv
    assert seq.block_table == [] and sch.bm.num_free_blocks == 16
    batch, outs, _ = step(sch)  # computed here: the prompt and the token it came with
    assert batch.num_new_tokens == [9] and said(outs) == [("r", [TOKEN], "length")]


def test_an_abort_during_a_pull_waits_for_its_answer() -> None:
    sch = create_scheduler()
    add(sch, "c", list(range(10, 18)), LONG, (9,), remote_kv=True)
    seq = sch.seqs["c"]
    sch.schedule()
    sch.abort("c")
    assert seq.status is WAITING_FOR_REMOTE_KV and sch.bm.num_free_blocks == 14
    sch.kv_ready("c")  # the pull stopped writing: now it ends, quietly
    assert seq.status is FINISHED and seq.finish_reason == "abort" and all_free(sch)
    # a request whose first token already ends it is never pulled
    out = add(sch, "e", [5] * 8, SamplingParams(max_tokens=1), (6,), remote_kv=True)
    assert said([out]) == [("e", [], "length")] and out.request_finished
    assert sch.schedule() is None and all_free(sch)


class FakeSpeculator:
    def __init__(self) -> None:
        self.verified_calls: list[tuple[str, int, int]] = []
        self.released: list[str] = []

    def verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.verified_calls.append((seq.seq_id, num_drafted, num_accepted))

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.seq_id)


def test_speculative_drafts_are_accepted_or_rolled_back() -> None:
    spec = FakeSpeculator()
    sch = create_scheduler(speculator=spec)
    add(sch, "s", [3, 4, 5, 6], SamplingParams(max_tokens=10, stop_token_ids=[40]))
    seq = sch.seqs["s"]
    step(sch)  # prefill: 5 tokens, 4 computed, one block
    seq.spec_token_ids = [20, 21, 22, 23]  # what the proposer drafted
    batch, outs, stats = step(sch, lambda s: [30])  # every draft rejected: 30 instead
    assert batch.num_new_tokens == [5] and batch.num_verifies == 1 and batch.num_decodes == 0
    assert said(outs) == [("s", [30], None)]
    assert (outs[0].num_draft_tokens, outs[0].num_accepted_tokens) == (4, 0)
    # rolled back: only the verified token's KV counts, and the block past it is freed
    assert seq.num_computed_tokens == 5 and len(seq.block_table) == 2 and seq.num_tokens == 6
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (1, 4, 0)
    assert spec.verified_calls == [("s", 4, 0)] and seq.spec_token_ids == []
    seq.spec_token_ids = [31, 32]
    _, outs, stats = step(sch, lambda s: [31, 32, 33])  # both accepted, and a bonus token
    assert said(outs) == [("s", [31, 32, 33], None)] and seq.num_computed_tokens == 8
    assert stats.spec_accepted_tokens == 2 and spec.verified_calls[-1] == ("s", 2, 2)
    seq.spec_token_ids = [40, 41]
    _, outs, _ = step(sch, lambda s: [40, 41, 42])  # a stop token among them ends it there
    assert said(outs) == [("s", [40], "stop")] and spec.released == ["s"] and all_free(sch)


def test_a_draft_is_cut_to_the_token_budget() -> None:
    sch = create_scheduler(max_num_batched_tokens=3, speculator=FakeSpeculator())
    add(sch, "s", [3, 4], LONG)
    step(sch)
    seq = sch.seqs["s"]
    seq.spec_token_ids = [20, 21, 22, 23]
    batch = sch.schedule()
    assert batch.num_new_tokens == [3] and seq.spec_token_ids == [20, 21]


def test_a_blocked_head_attaches_and_counts_no_prefix_hit() -> None:
    sch = create_scheduler(num_blocks=6)
    bm = sch.bm
    cached = list(range(10, 18))  # two full blocks, cached once "a" computed them
    add(sch, "a", [*cached, 18], SamplingParams(max_tokens=1))
    step(sch)
    hits_of_a = [bm.hash_to_block[h] for h in bm.drain_events()[0]]
    add(sch, "big", list(range(50, 62)), LONG)  # runs on, leaving too few blocks for "b"
    step(sch)
    add(sch, "b", [*cached, 99, 98, 97, 96, 95], LONG)
    b = sch.seqs["b"]
    step(sch)  # big takes its fourth block; b's 2 new + 2 cached blocks do not fit
    assert bm.num_free_blocks == 2 and b.status is WAITING
    counted = (bm.prefix_queries, bm.prefix_hits)
    free = list(bm.free)
    for _ in range(3):
        batch, _, _ = step(sch)
        assert [s.bus_id for s in batch.seqs] == ["big"] and list(sch.waiting) == [b]
    assert (bm.prefix_queries, bm.prefix_hits) == counted and list(bm.free) == free
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_prefix_hit_tokens == 0
    assert all(bm.ref_counts[block] == 0 for block in hits_of_a)
    sch.abort("big")
    batch, _, stats = step(sch)
    assert batch.seqs == [b] and batch.num_new_tokens == [5] and stats.prefill_seqs == {"b": 8}
    assert (bm.prefix_queries, bm.prefix_hits) == (counted[0] + 3, counted[1] + 2)
    assert b.block_table[:2] == hits_of_a and b.num_prefix_hit_tokens == 8


def test_a_prefill_only_engine_parks_the_prompt_until_release() -> None:
    sch = create_scheduler(prefill_only=True)
    add(sch, "p", [3, 4, 5, 6, 8, 9], SamplingParams(max_tokens=4))
    seq = sch.seqs["p"]
    _, outs, _ = step(sch)
    assert said(outs) == [("p", [TOKEN], None)] and not outs[0].request_finished
    assert outs[0].kv_block_ids == seq.block_table and outs[0].num_kv_tokens == 6
    assert seq.status is PREFILLED and not sch.has_work() and sch.bm.num_free_blocks == 14
    sch.release("p")
    assert seq.status is FINISHED and all_free(sch)


def test_a_held_block_is_refused_while_requests_wait() -> None:
    sch = create_scheduler()
    block = sch.hold_block("doctor-a")
    assert sch.seqs["doctor-a"].status is PREFILLED and sch.bm.ref_counts[block] == 1
    with pytest.raises(BlockHoldRefused, match="exists"):
        sch.hold_block("doctor-a")
    add(sch, "w", [3, 4])
    with pytest.raises(BlockHoldRefused, match="waiting"):
        sch.hold_block("doctor-b")
    sch.abort("w")
    sch.release("doctor-a")
    assert all_free(sch)
