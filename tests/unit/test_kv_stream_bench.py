"""perf/kv_stream_bench's arithmetic on made-up runs (the benchmark itself needs SmolLM2 and
minutes per stack)."""

from __future__ import annotations

from perf.kv_stream_bench import SIZES, summarize


def run(ttft: float, gap: float, pull: float | None) -> dict:
    return {size: {"ttft_s": [ttft], "gap_s": [gap], "pull_s_mean": pull} for size in SIZES}


def test_the_gap_saved_is_read_against_the_bulk_pull() -> None:
    runs = {
        "bulk": [run(1.0, 0.30, 0.10), run(1.0, 0.30, 0.10)],
        "streamed": [run(1.0, 0.22, 5.0), run(1.0, 0.22, 5.0)],
    }
    got = summarize(runs)[SIZES[0]]
    assert got["saved_s"] == 0.08 and got["saved_per_pull"] == 0.8
    assert got["second_token_ratio"] == round(1.22 / 1.30, 4)
    assert got["pull_bulk_s"] == 0.10  # a streamed pull's own time includes its wait: unused
