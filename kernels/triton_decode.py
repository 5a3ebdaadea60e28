"""Paged decode attention with GQA and split-K (flash-decoding).

One program owns (sequence, kv head, split): it loads the `group` query heads that share the kv
head once, streams its share of the sequence's cached tokens page by page through the block table,
and keeps an online softmax. Reading each K/V byte exactly once is what makes decode run at memory
bandwidth. When batch x kv heads is too small to fill the GPU (few sequences, long contexts), the
context is split across programs and a second tiny kernel merges their partial softmaxes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_attention_common import LOG2E, dot_precision, num_sms, paged_rows


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    group,
    block_size: tl.constexpr,
    partition_size,
    num_splits,
    stride_q_seq,
    stride_q_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # kv head varies fastest: programs running side by side read neighbouring head slices of
    # the same page, so DRAM sees whole token rows rather than scattered 2*head_dim byte pieces.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(context_len, start + partition_size)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    table_row = block_tables_ptr + seq * stride_table_seq
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        valid = tokens < end
        rows = paged_rows(
            table_row,
            tokens,
            valid,
            kv_head,
            block_size,
            stride_cache_block,
            stride_cache_offset,
            stride_cache_head,
        )
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite from the first tile on.
        # The softmax scale rides inside exp2's argument (one FMA per score).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        # An empty context attends nothing: zeros rather than 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials are [B, Hq, splits(, D)] fp32; splits past the context store (-inf, 0, 0).
        part = (seq * tl.num_programs(0) * group + heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    num_splits,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = splits < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    has_tokens = l_s > 0
    m_max = tl.max(tl.where(has_tokens, m, -1e30), axis=0)
    weight = tl.where(has_tokens, tl.exp2(m - m_max), 0.0)
    total = tl.sum(l_s * weight, axis=0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# Programs of the default config that fit on one SM at once (96 registers x 128 threads, ~38 KB
# shared memory on sm_90 allow 5; 4 leaves room for what the compiler of the day does).
RESIDENT_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # cached tokens per inner-loop tile
    num_splits: int  # context partitions per (sequence, kv head)
    num_warps: int = 4
    num_stages: int = 2


def choose_decode_config(
    batch: int, num_kv_heads: int, max_context: int, head_dim: int, device: torch.device
) -> DecodeConfig:
    """Pick the context split that keeps HBM busy to the end.

    Every (sequence, kv head) program streams the same bytes, so programs run in lockstep
    waves. A single wave needs about two programs per SM to keep enough loads in flight; beyond
    one wave, a last wave that is mostly empty leaves bandwidth idle for its whole duration
    (1.2 waves cost as much as 2). So: the fewest splits that reach ~90% of either ideal, and
    never a split shorter than ~256 tokens.
    """
    block_n = 64 if head_dim <= 128 else 32
    sms = num_sms(device)
    resident = RESIDENT_PROGRAMS_PER_SM * sms
    base = max(1, batch * num_kv_heads)
    max_splits = max(1, min(64, max_context // 256))

    def efficiency(splits: int) -> float:
        programs = base * splits
        if programs <= resident:
            return min(1.0, programs / (2 * sms))
        waves = programs / resident
        return waves / math.ceil(waves)

    scored = [(efficiency(s), s) for s in range(1, max_splits + 1)]
    good = [s for e, s in scored if e >= 0.9]
    num_splits = good[0] if good else max(scored)[1]
    return DecodeConfig(block_n=block_n, num_splits=num_splits)


def decode_attention_with(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    config: DecodeConfig,
) -> Tensor:
    """decode_attention with an explicit tiling/split choice (tests and the benchmark pin it)."""
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    assert k_cache.stride() == v_cache.stride(), "K and V views must share one layout"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    # Context is bounded by the table width; sizing splits from it avoids a host sync on
    # context_lens. Splits that start past a sequence's end exit at once.
    max_context = block_tables.shape[1] * block_size
    num_splits = max(1, min(config.num_splits, triton.cdiv(max_context, config.block_n)))
    partition = triton.cdiv(triton.cdiv(max_context, num_splits), config.block_n) * config.block_n
    block_d = triton.next_power_of_2(head_dim)
    single = num_splits == 1
    if single:
        part_acc = part_max = part_sum = out  # unused
    else:
        part_max = torch.empty(
            (batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        scale * LOG2E,
        group,
        block_size,
        partition,
        num_splits,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        SINGLE_SPLIT=single,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not single:
        _decode_merge_kernel[(batch, num_q_heads)](
            part_acc,
            part_max,
            part_sum,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    plan: object | None = None,
) -> Tensor:
    """See kernels.ops.decode_attention. The kernel reads pages in place: it needs no plan."""
    config = choose_decode_config(
        q.shape[0],
        k_cache.shape[2],
        block_tables.shape[1] * k_cache.shape[1],
        q.shape[2],
        q.device,
    )
    return decode_attention_with(q, k_cache, v_cache, block_tables, context_lens, scale, config)
