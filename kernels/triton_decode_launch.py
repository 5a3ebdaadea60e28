"""How the decode kernel is launched: tile sizes, context splits and query rows per program.

Pure host-side arithmetic (no Triton launch), so the benchmark and the tests can reason about a
configuration without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from pdserve.kernels.triton_attention_common import num_sms

# Programs of the default config that fit on one SM at once (96 registers x 128 threads, ~38 KB
# shared memory on sm_90 allow 5; 4 leaves room for what the compiler of the day does).
RESIDENT_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # cached tokens per inner-loop tile
    num_splits: int  # context partitions per (sequence, kv head)
    num_warps: int = 4
    num_stages: int = 2


# Most (query token, q head) rows one program holds: a [64, D] fp32 accumulator and [64, BLOCK_N]
# scores stay in registers; a sequence with more rows (q_len x GQA group) gets several programs.
MAX_QUERY_ROWS = 64

# Multi-query launches by rows per program, from ptxas on sm_90 (tests/kernels/compile_sm90.py,
# head dim 128): (num_warps, programs resident per SM). 16 rows take ~126 registers x 128
# threads, so 4 fit; 32 rows want 8 warps to stay near 100 registers (2 fit); 64 rows take ~160
# registers x 256 threads (1 fits).
MULTI_QUERY_LAUNCH = {16: (4, 4), 32: (8, 2), 64: (8, 1)}


@dataclass(frozen=True)
class QueryLayout:
    """How a step's query rows map onto programs: one row block of block_m rows, or several."""

    multi_query: bool  # several query tokens per sequence (cu_seqlens_q is read)
    block_m: int  # rows per program: (query, head of the kv group) pairs, a power of 2 >= 16
    row_blocks: int  # programs per (sequence, kv head, split)


def query_layout(group: int, cu_seqlens_q: Tensor | None, max_seqlen_q: int) -> QueryLayout:
    if cu_seqlens_q is None or max_seqlen_q <= 1:
        # One query per sequence: the group's heads are the rows (tl.dot wants >= 16 of them).
        return QueryLayout(False, max(16, triton.next_power_of_2(group)), 1)
    rows = max_seqlen_q * group
    block_m = min(MAX_QUERY_ROWS, max(16, triton.next_power_of_2(rows)))
    return QueryLayout(True, block_m, triton.cdiv(rows, block_m))


def choose_decode_config(
    batch: int,
    num_kv_heads: int,
    max_context: int,
    head_dim: int,
    device: torch.device,
    layout: QueryLayout | None = None,
) -> DecodeConfig:
    """Pick the context split that keeps HBM busy to the end.

    Every (sequence, kv head[, row block]) program streams the same bytes, so programs run in
    lockstep waves. A single wave needs about two programs per SM to keep enough loads in
    flight; beyond one wave, a last wave that is mostly empty leaves bandwidth idle for its
    whole duration (1.2 waves cost as much as 2). So: the fewest splits that reach ~90% of either
    ideal, and never a split shorter than ~256 tokens.
    """
    block_n = 64 if head_dim <= 128 else 32
    num_warps, per_sm = 4, RESIDENT_PROGRAMS_PER_SM
    row_blocks = 1
    if layout is not None and layout.multi_query:
        num_warps, per_sm = MULTI_QUERY_LAUNCH[layout.block_m]
        row_blocks = layout.row_blocks
    sms = num_sms(device)
    resident = per_sm * sms
    base = max(1, batch * num_kv_heads * row_blocks)
    max_splits = max(1, min(64, max_context // 256))

    def efficiency(splits: int) -> float:
        programs = base * splits
        if programs <= resident:
            return min(1.0, programs / (min(2, per_sm) * sms))
        waves = programs / resident
        return waves / math.ceil(waves)

    scored = [(efficiency(s), s) for s in range(1, max_splits + 1)]
    good = [s for e, s in scored if e >= 0.9]
    num_splits = good[0] if good else max(scored)[1]
    return DecodeConfig(block_n=block_n, num_splits=num_splits, num_warps=num_warps)
