"""The profiler's measurements on a real engine (the demo model, in this process): a decode cell
runs exactly its batch on the pool sized for it, even where the scheduler's admission headroom
bites (a large batch of long contexts), and a prefill point is a prompt timed to its first token.
The lengths asked for are capped at what the model takes, never silently dropped."""

from __future__ import annotations

import pytest

from pdserve.services.control.planner.measure import (
    ProfileInputError,
    cap_lengths,
    decode_pool_blocks,
    measure_decode,
    measure_prefill,
)
from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig


def count_steps(engine: LLMEngine) -> list[int]:
    """A one-item list that counts the engine's steps from here on (the real steps, wrapped)."""
    count, inner = [0], engine.step

    def step():
        count[0] += 1
        return inner()

    engine.step = step  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize(("batch", "context"), [(8, 4096), (13, 1000)])
def test_a_decode_cell_runs_its_whole_batch_on_the_pool_sized_for_it(batch, context) -> None:
    steps = 2
    blocks = decode_pool_blocks(batch, context, steps, 16)
    engine = LLMEngine(EngineConfig(model="demo", num_kv_blocks=blocks, block_size=16))
    # the largest cell, then a smaller one on the same engine: the first one's blocks came back;
    # a second pass over the grid comes back to each cell, and still one point a cell
    stepped = count_steps(engine)
    points = measure_decode(engine, [1, batch], [context], steps, passes=2)
    assert [(b, c) for b, c, _ in points] == [(1, context), (batch, context)]
    # a throwaway cell, then 2 cells x 2 passes: each admits, warms up, times its steps, drains
    assert stepped[0] >= 5 * (1 + 1 + steps)
    assert all(itl > 0 for _, _, itl in points)
    assert engine.block_manager.num_free_blocks == blocks  # every cell's blocks freed
    # one block fewer per sequence and the batch no longer fits: the sizing is not loose by luck
    tight = LLMEngine(EngineConfig(model="demo", num_kv_blocks=blocks - batch - blocks // 50))
    with pytest.raises(RuntimeError, match="admitted"):
        measure_decode(tight, [batch], [context], steps)


def test_prefill_points_are_prompts_timed_to_their_first_token() -> None:
    engine = LLMEngine(EngineConfig(model="demo", max_num_batched_tokens=256))
    # no time budget to cut the repetitions short: exactly ``reps`` of each, on any machine
    points = measure_prefill(engine, [32, 600], reps=2, rep_seconds=float("inf"))
    assert [(n, reps) for n, _, reps in points] == [(32, 2), (600, 2)]
    assert all(tps > 0 for _, tps, _ in points)
    # 600 tokens ran in three chunks of 256 and was timed as one prompt: slower than 32 tokens
    assert 600 / points[1][1] > 32 / points[0][1]
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # leases released
    assert not engine.has_unfinished()
    # a spent budget stops after the one repetition every point gets
    once = measure_prefill(engine, [32, 600], reps=5, rep_seconds=0.0)
    assert [(n, reps) for n, _, reps in once] == [(32, 1), (600, 1)]


def test_lengths_beyond_the_context_are_capped_to_it() -> None:
    assert cap_lengths([128, 512, 2048, 8192], 8191, "prompt lengths") == [128, 512, 2048, 8191]
    assert cap_lengths([4096, 9000], 1000, "decode contexts") == [1000]
    assert cap_lengths([64, 256], 8000, "decode contexts") == [64, 256]
    with pytest.raises(ProfileInputError):
        cap_lengths([64], 0, "decode contexts")
