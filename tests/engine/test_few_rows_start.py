"""The few-rows matmul forms are chosen while the engine loads, never in a step: timed in the
step that first met a row count, they were timed on the LM head (113 MB on SmolLM2), and each
new decode batch size of 2-7 or batch of prompts stalled its step by seconds."""

from __future__ import annotations

import pytest

from pdserve.services.engine import few_rows
from pdserve.services.engine.few_rows import FewRowsLinear
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts


@pytest.fixture
def fresh_timings(monkeypatch):
    monkeypatch.setattr(few_rows, "_FORM", {})


def test_every_few_row_count_is_timed_at_start_and_no_step_times_one(
    llama_dir, fresh_timings, monkeypatch
) -> None:
    engine = make_engine(llama_dir, dtype="float32", max_num_batched_tokens=256)
    assert set(few_rows._FORM) == set(few_rows.FEW_ROWS)

    def timed_in_a_step(self, x):
        raise AssertionError(f"a step timed the few-rows forms for {x.shape[0]} rows")

    monkeypatch.setattr(FewRowsLinear, "_time_forms", timed_in_a_step)
    # prompts of 1-8 at once, then decode batches shrinking from 8 to 1 as they finish
    for i, prompt in enumerate(random_prompts(8, seed=4, max_len=12)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2 + i, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps > 8
