"""Which KV heads each tensor-parallel rank holds, and which ranks a puller reads them from.

A worker of TP ``N`` splits the model's attention heads evenly over its ranks. Its KV heads are
split the same way while there are at least ``N`` of them; past that (``N`` a multiple of the KV
heads) each KV head is replicated on ``N / kv_heads`` consecutive ranks, as vLLM does, so every
rank still holds the KV its query heads read. A rank's heads are always one contiguous range.

Prefill and decode workers may run different TP sizes. A decode rank pulls exactly its own range,
cut at the prefill ranks' boundaries, each piece from one prefill rank that holds it: the pulls
of all ranks run in parallel, and no rank ever gathers another's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

TP_KEY = "tensor_parallel_size"  # the layout fingerprint's TP entry (LLMEngine.layout_fingerprint)


def tp_problem(
    num_heads: int, num_kv_heads: int, tp: int, devices: int | None = None
) -> str | None:
    """Why a model with these heads cannot be sharded ``tp`` ways (one line naming the numbers),
    or None. ``devices``: how many a rank each may take (GPUs), when that bounds TP."""
    if tp < 1:
        return f"--tensor-parallel-size must be at least 1, got {tp}"
    if devices is not None and tp > devices:
        return f"--tensor-parallel-size {tp} exceeds the {devices} devices available"
    if num_heads % tp:
        return f"{num_heads} attention heads are not divisible by --tensor-parallel-size {tp}"
    if tp <= num_kv_heads and num_kv_heads % tp:
        return f"{num_kv_heads} KV heads are not divisible by --tensor-parallel-size {tp}"
    if tp > num_kv_heads and tp % num_kv_heads:
        return (
            f"--tensor-parallel-size {tp} exceeds the {num_kv_heads} KV heads and is not a "
            "multiple of them (each KV head is replicated on tp / kv_heads ranks)"
        )
    return None


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The global KV heads ``[lo, hi)`` that ``rank`` of a TP-``tp`` worker holds."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside TP {tp}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def head_range(num_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The global query heads ``[lo, hi)`` of ``rank`` (always an even split)."""
    per = num_heads // tp
    return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class PullPiece:
    """One head-sliced pull of a decode rank: KV heads ``[lo, hi)`` from ``prefill_rank``."""

    prefill_rank: int
    lo: int
    hi: int


def pull_plan(
    num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int
) -> list[PullPiece]:
    """The pieces decode rank ``decode_rank`` pulls: its own KV heads, cut where prefill ranks'
    ranges end. A head that several prefill ranks replicate is read from one of them, chosen by
    the decode rank so that the decode ranks spread over the replicas."""
    lo, hi = kv_head_range(num_kv_heads, decode_tp, decode_rank)
    pieces: list[PullPiece] = []
    head = lo
    while head < hi:
        holders = [
            r
            for r in range(prefill_tp)
            if kv_head_range(num_kv_heads, prefill_tp, r)[0] <= head
            and head < kv_head_range(num_kv_heads, prefill_tp, r)[1]
        ]
        rank = holders[decode_rank % len(holders)]
        end = min(hi, kv_head_range(num_kv_heads, prefill_tp, rank)[1])
        pieces.append(PullPiece(rank, head, end))
        head = end
    return pieces


def without_tp(fingerprint: dict) -> dict:
    """The part of a layout fingerprint both ends of a pull must share: everything but TP, which
    head-sliced pulls bridge."""
    return {k: v for k, v in fingerprint.items() if k != TP_KEY}
