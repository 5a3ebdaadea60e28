"""Paged decode attention with GQA and split-K (flash-decoding), one or a few queries per sequence.

One program owns (sequence, kv head, split): it loads the `group` query heads that share the kv
head once, streams its share of the sequence's cached tokens page by page through the block table,
and keeps an online softmax. Reading each K/V byte exactly once is what makes decode run at memory
bandwidth. When batch x kv heads is too small to fill the GPU (few sequences, long contexts), the
context is split across programs and a second tiny kernel merges their partial softmaxes.

Speculative verification brings 1 + k query tokens per sequence. They join the same program as
more rows: (query token, head of the group) pairs, so the pages are still read once per
(sequence, kv head) rather than once per query, and a causal mask keeps each query to the keys
up to its own position. Only past MAX_QUERY_ROWS rows (q_len x group) does a sequence take
several programs. With one query per sequence the kernel compiles to the plain decode kernel.

A quantized cache (int8 / float8_e4m3fn values, one float32 scale per token and kv head) is read
in place: its tiles convert exactly to the query's dtype for the dots, each score column is
multiplied by its key's scale after q.k, and p by each value's scale before p.v, so the
dequantized cache never exists. A float cache compiles to the kernel without any of this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.triton_attention_common import LOG2E, cache_rows, dot_precision, scale_strides
from pdserve.kernels.triton_decode_launch import DecodeConfig, choose_decode_config, query_layout


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    cu_seqlens_q_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    group,
    num_q_heads,
    row_blocks,
    block_size: tl.constexpr,
    partition_size,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    stride_out_tok,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    MULTI_QUERY: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # kv head varies fastest: programs running side by side read neighbouring head slices of
    # the same page, so DRAM sees whole token rows rather than scattered 2*head_dim byte pieces.
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(context_len, start + partition_size)
    r = tl.arange(0, BLOCK_M)
    if MULTI_QUERY:
        # Rows are (query token, head of the kv group), tokens outermost, so every query of the
        # sequence shares this program's one pass over its pages. A row block is BLOCK_M of them.
        kv_head = tl.program_id(0) // row_blocks
        first_row = (tl.program_id(0) % row_blocks) * BLOCK_M
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start  # int32: positions stay 32-bit
        r += first_row
        row_mask = r < q_len * group
        j = r // group
        heads = kv_head * group + r % group
        token = q_start.to(tl.int64) + j
        q_pos = context_len - q_len + j  # query j's position: it sees keys 0..q_pos
        # Keys past this block's last query are nobody's here; a block of padding rows only
        # (a sequence shorter than the longest) reads nothing.
        last_j = tl.minimum(q_len - 1, (first_row + BLOCK_M - 1) // group)
        end = tl.minimum(end, context_len - q_len + last_j + 1)
        end = tl.where(first_row < q_len * group, end, start)
    else:
        kv_head = tl.program_id(0)
        row_mask = r < group
        heads = kv_head * group + r
        token = seq
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    if MULTI_QUERY:
        q_rows = q_ptr + token[:, None] * stride_q_tok
    else:
        q_rows = q_ptr + token * stride_q_tok
    q = tl.load(
        q_rows + heads[:, None] * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    table_row = block_tables_ptr + seq * stride_table_seq
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        valid = tokens < end
        rows, scale_rows = cache_rows(
            table_row,
            tokens,
            valid,
            kv_head,
            block_size,
            stride_cache_block,
            stride_cache_offset,
            stride_cache_head,
            stride_scale_block,
            stride_scale_offset,
            stride_scale_head,
            KV_QUANT,
        )
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:
            # int8 and e4m3 values are exact in bf16/fp16/fp32: the dot sees the stored numbers.
            k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if KV_QUANT:
            scores *= tl.load(k_scale_ptr + scale_rows, mask=valid, other=0.0)[None, :]
        if MULTI_QUERY:
            seen = valid[None, :] & (tokens[None, :] <= q_pos[:, None])
            scores = tl.where(seen, scores, float("-inf"))
        else:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        # The softmax scale rides inside exp2's argument (one FMA per score).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale_log2)
        if MULTI_QUERY:
            # An early query may see no key of a tile (or of a whole split) yet: its max stays
            # -inf, and -inf - -inf would be NaN; exponents taken against 0 give exactly 0.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # Every tile holds at least one valid token: m_new is finite from the first tile on.
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores * scale_log2 - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:
            # l_i keeps the unscaled p: the value scales weigh only what p.v adds up.
            p *= tl.load(v_scale_ptr + scale_rows, mask=valid, other=0.0)[None, :]
            v = v.to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        # An empty context attends nothing: zeros rather than 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if MULTI_QUERY:
            out_rows = out_ptr + token[:, None] * stride_out_tok
        else:
            out_rows = out_ptr + token * stride_out_tok
        tl.store(
            out_rows + heads[:, None] * stride_out_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials are [T, Hq, splits(, D)] fp32; splits past the context store (-inf|0, 0, 0):
        # the merge weighs only splits with l > 0.
        part = (token * num_q_heads + heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    num_splits,
    stride_out_tok,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per (query token, q head); a token's partials are contiguous per head
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = splits < num_splits
    part = (token * tl.num_programs(1) + head) * num_splits + splits
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
        out_ptr + token * stride_out_tok + head * stride_out_head + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def decode_attention_with(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    config: DecodeConfig,
    cu_seqlens_q: Tensor | None = None,
    max_seqlen_q: int = 1,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """decode_attention with an explicit tiling/split choice (tests and the benchmark pin it)."""
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = block_tables.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    assert k_cache.stride() == v_cache.stride(), "K and V views must share one layout"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    layout = query_layout(group, cu_seqlens_q, max_seqlen_q)
    if not layout.multi_query:
        assert num_tokens == batch, "one query per sequence unless cu_seqlens_q says otherwise"
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
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    grid = (num_kv_heads * layout.row_blocks, batch, num_splits)
    _decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # scales unused for a float cache
        v_cache if v_scale is None else v_scale,
        block_tables,
        context_lens,
        cu_seqlens_q if layout.multi_query else context_lens,  # unused when one query each
        out,
        part_acc,
        part_max,
        part_sum,
        scale * LOG2E,
        group,
        num_q_heads,
        layout.row_blocks,
        block_size,
        partition,
        num_splits,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides(k_scale, v_scale),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        MULTI_QUERY=layout.multi_query,
        SINGLE_SPLIT=single,
        KV_QUANT=k_scale is not None,
        BLOCK_M=layout.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not single:
        _decode_merge_kernel[(num_tokens, num_q_heads)](
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
    cu_seqlens_q: Tensor | None = None,
    max_seqlen_q: int = 1,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """See pdserve.kernels.ops.decode_attention. The kernel reads pages in place: it needs no plan."""
    num_kv_heads = k_cache.shape[2]
    layout = query_layout(q.shape[1] // num_kv_heads, cu_seqlens_q, max_seqlen_q)
    config = choose_decode_config(
        block_tables.shape[0],
        num_kv_heads,
        block_tables.shape[1] * k_cache.shape[1],
        q.shape[2],
        q.device,
        layout,
    )
    return decode_attention_with(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        config,
        cu_seqlens_q,
        max_seqlen_q,
        k_scale,
        v_scale,
    )
