"""Which KV heads each TP rank holds, and the head-sliced pull plan between TP sizes."""

from __future__ import annotations

import pytest

from pdserve.shared.kv.tp_layout import (
    TP_KEY,
    PullPiece,
    kv_head_range,
    pull_plan,
    tp_problem,
    without_tp,
)


def test_kv_heads_split_evenly_while_there_are_enough() -> None:
    assert [kv_head_range(4, 1, 0)] == [(0, 4)]
    assert [kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(3, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]


def test_kv_heads_replicate_past_their_number() -> None:
    # each KV head on tp / kv_heads consecutive ranks
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]


@pytest.mark.parametrize("rank", [-1, 2])
def test_kv_head_range_rejects_ranks_outside_tp(rank: int) -> None:
    with pytest.raises(ValueError, match="outside TP"):
        kv_head_range(4, 2, rank)


def test_tp_problem_names_the_numbers() -> None:
    assert tp_problem(8, 4, 1) is None
    assert tp_problem(8, 4, 2) is None
    assert tp_problem(8, 2, 4) is None  # replicated KV heads
    assert tp_problem(8, 1, 8) is None
    assert "at least 1" in tp_problem(8, 4, 0)
    assert "exceeds the 2 devices" in tp_problem(8, 4, 4, devices=2)
    assert tp_problem(8, 4, 2, devices=2) is None
    assert "12 attention heads" in tp_problem(12, 4, 8)
    assert "6 KV heads" in tp_problem(12, 6, 4)
    assert "not a multiple" in tp_problem(12, 4, 6)


def test_pull_plan_one_to_two() -> None:
    assert pull_plan(4, 1, 2, 0) == [PullPiece(0, 0, 2)]
    assert pull_plan(4, 1, 2, 1) == [PullPiece(0, 2, 4)]


def test_pull_plan_two_to_one_reads_each_half_from_its_holder() -> None:
    assert pull_plan(4, 2, 1, 0) == [PullPiece(0, 0, 2), PullPiece(1, 2, 4)]


def test_pull_plan_same_tp_pulls_from_the_same_rank() -> None:
    assert pull_plan(4, 2, 2, 0) == [PullPiece(0, 0, 2)]
    assert pull_plan(4, 2, 2, 1) == [PullPiece(1, 2, 4)]


def test_pull_plan_three_to_one() -> None:
    assert pull_plan(3, 3, 1, 0) == [PullPiece(0, 0, 1), PullPiece(1, 1, 2), PullPiece(2, 2, 3)]


def test_pull_plan_spreads_decode_ranks_over_replicas() -> None:
    # kv_heads=2, prefill TP 4: ranks 0,1 hold head 0 and 2,3 head 1
    assert pull_plan(2, 4, 1, 0) == [PullPiece(0, 0, 1), PullPiece(2, 1, 2)]
    assert pull_plan(2, 4, 2, 0) == [PullPiece(0, 0, 1)]
    assert pull_plan(2, 4, 2, 1) == [PullPiece(3, 1, 2)]
    # decode TP 4 too: every decode rank reads its head from a prefill rank that holds it
    assert [pull_plan(2, 4, 4, r) for r in range(4)] == [
        [PullPiece(0, 0, 1)],
        [PullPiece(1, 0, 1)],
        [PullPiece(2, 1, 2)],
        [PullPiece(3, 1, 2)],
    ]
    # kv_heads=1 with TP 2 on either side
    assert pull_plan(1, 2, 1, 0) == [PullPiece(0, 0, 1)]
    assert [pull_plan(1, 1, 2, r) for r in range(2)] == [[PullPiece(0, 0, 1)]] * 2
    assert [pull_plan(1, 2, 2, r) for r in range(2)] == [[PullPiece(0, 0, 1)], [PullPiece(1, 0, 1)]]


CASES = [
    (kv, p, d)
    for kv in (1, 2, 3, 4, 8)
    for p in (1, 2, 3, 4, 8)
    for d in (1, 2, 3, 4, 8)
    if tp_problem(8 * 3, kv, p) is None and tp_problem(8 * 3, kv, d) is None
]


@pytest.mark.parametrize(("kv", "prefill_tp", "decode_tp"), CASES)
def test_pieces_tile_the_decode_ranks_heads_from_ranks_that_hold_them(
    kv: int, prefill_tp: int, decode_tp: int
) -> None:
    for rank in range(decode_tp):
        pieces = pull_plan(kv, prefill_tp, decode_tp, rank)
        lo, hi = kv_head_range(kv, decode_tp, rank)
        assert pieces[0].lo == lo and pieces[-1].hi == hi
        for a, b in zip(pieces, pieces[1:], strict=False):
            assert a.hi == b.lo  # contiguous, no overlap, no gap
        for piece in pieces:
            assert piece.lo < piece.hi
            held = kv_head_range(kv, prefill_tp, piece.prefill_rank)
            assert held[0] <= piece.lo and piece.hi <= held[1]


def test_without_tp_drops_only_the_tp_entry() -> None:
    fp = {"model": "m", "num_kv_heads": 4, TP_KEY: 2}
    assert without_tp(fp) == {"model": "m", "num_kv_heads": 4}
    assert without_tp(fp) == without_tp({**fp, TP_KEY: 1}) == without_tp(without_tp(fp))
    assert fp[TP_KEY] == 2  # not modified
