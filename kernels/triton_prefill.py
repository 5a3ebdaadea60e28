"""Varlen causal prefill attention (flash-attention forward) with GQA and an optional paged prefix.

One program owns BLOCK_M queries of one sequence and one query head. Keys come either from the
packed k/v of this forward pass or, when block tables are given, from the paged cache (where the
new tokens were already stored), so a prompt whose prefix is cached, or a later chunk of a long
prompt, attends its whole history. Key tiles left of the first query of the block need no causal
mask; only the diagonal tiles pay for one.

A quantized paged cache (int8 / float8_e4m3fn values, one float32 scale per token and kv head)
is read in place as in triton_decode.py: tiles convert exactly to the query's dtype, scores are
scaled by the key scales after q.k and p by the value scales before p.v. Host-side launch
bookkeeping lives in triton_prefill_launch.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.triton_attention_common import LOG2E, dot_precision, key_rows
from pdserve.kernels.triton_prefill_launch import PrefillConfig, choose_prefill_config, prefill_keys


@triton.jit
def _load_rows(ptrs, key_valid, d_mask, MASK_KEYS: tl.constexpr, EVEN_D: tl.constexpr):
    # Masks only where a tile can hold keys past the end or a padded head dim: unmasked loads
    # keep the copies wide and unpredicated.
    if MASK_KEYS:
        if EVEN_D:
            return tl.load(ptrs, mask=key_valid[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=key_valid[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _load_scales(ptrs, key_valid, MASK_KEYS: tl.constexpr):
    if MASK_KEYS:
        return tl.load(ptrs, mask=key_valid, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    k_scale_base,
    v_scale_base,
    k_rows,
    v_rows,
    scale_rows,
    key_valid,
    allowed,
    d,
    d_mask,
    scale_log2,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    k = _load_rows(k_base + k_rows[:, None] + d[None, :], key_valid, d_mask, MASKED, EVEN_D)
    if KV_QUANT:
        # int8 and e4m3 values are exact in bf16/fp16/fp32: the dot sees the stored numbers.
        k = k.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if KV_QUANT:
        scores *= _load_scales(k_scale_base + scale_rows, key_valid, MASKED)[None, :]
    if MASKED:
        scores = tl.where(allowed, scores, float("-inf"))
    # The softmax scale rides inside exp2's argument (one FMA per score).
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_rows(v_base + v_rows[:, None] + d[None, :], key_valid, d_mask, MASKED, EVEN_D)
    if KV_QUANT:
        # l_i keeps the unscaled p: the value scales weigh only what p.v adds up.
        p *= _load_scales(v_scale_base + scale_rows, key_valid, MASKED)[None, :]
        v = v.to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    out_ptr,
    scale_log2,
    group,
    block_size: tl.constexpr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Longest-running query blocks (bottom of the causal triangle) are launched first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    kv_head = head // group
    # Query row r of this sequence sits at absolute position prefix + r.
    prefix = k_len - q_len

    rows_q = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_valid = rows_q < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_start + rows_q).to(tl.int64)[:, None] * stride_q_token
        + head * stride_q_head
        + d[None, :],
        mask=q_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + rows_q
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys < first query position + 1 are visible to every row: no mask in these tiles.
    full_end = ((prefix + m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        always = keys < full_end
        k_rows, v_rows, scale_rows = key_rows(
            keys,
            always,
            kv_head,
            k_start,
            table_row,
            block_size,
            stride_k_token,
            stride_k_head,
            stride_v_token,
            stride_v_head,
            stride_cache_block,
            stride_cache_offset,
            stride_cache_head,
            stride_scale_block,
            stride_scale_offset,
            stride_scale_head,
            PAGED,
            KV_QUANT,
        )
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            v_scale_ptr,
            k_rows,
            v_rows,
            scale_rows,
            always,
            always,
            d,
            d_mask,
            scale_log2,
            False,
            HEAD_DIM == BLOCK_D,
            PRECISION,
            KV_QUANT,
        )

    # Diagonal tiles: causal and length masks. Each row sees key 0 or already saw a full tile,
    # so no row is ever all -inf.
    end = tl.minimum(k_len, prefix + (m_block + 1) * BLOCK_M)
    for tile_start in range(full_end, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_valid = keys < k_len
        k_rows, v_rows, scale_rows = key_rows(
            keys,
            key_valid,
            kv_head,
            k_start,
            table_row,
            block_size,
            stride_k_token,
            stride_k_head,
            stride_v_token,
            stride_v_head,
            stride_cache_block,
            stride_cache_offset,
            stride_cache_head,
            stride_scale_block,
            stride_scale_offset,
            stride_scale_head,
            PAGED,
            KV_QUANT,
        )
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            v_scale_ptr,
            k_rows,
            v_rows,
            scale_rows,
            key_valid,
            (keys[None, :] <= q_pos[:, None]) & key_valid[None, :],
            d,
            d_mask,
            scale_log2,
            True,
            HEAD_DIM == BLOCK_D,
            PRECISION,
            KV_QUANT,
        )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr
        + (q_start + rows_q).to(tl.int64)[:, None] * stride_out_token
        + head * stride_out_head
        + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_valid[:, None] & d_mask[None, :],
    )


def prefill_attention_with(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    k_cache: Tensor | None,
    v_cache: Tensor | None,
    block_tables: Tensor | None,
    config: PrefillConfig,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """prefill_attention with an explicit tiling (tests and the benchmark pin it)."""
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    src = prefill_keys(k, v, cu_seqlens_k, k_cache, v_cache, block_tables, k_scale, v_scale)
    assert q.stride(-1) == 1
    grid = (triton.cdiv(max_seqlen_q, config.block_m), batch, num_q_heads)
    _prefill_kernel[grid](
        q,
        src.keys,
        src.values,
        src.k_scales,
        src.v_scales,
        src.block_tables,
        cu_seqlens_q,
        cu_seqlens_k,
        out,
        scale * LOG2E,
        num_q_heads // src.num_kv_heads,
        src.block_size,
        q.stride(0),
        q.stride(1),
        *src.strides,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        PAGED=src.paged,
        KV_QUANT=src.quantized,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    k_cache: Tensor | None = None,
    v_cache: Tensor | None = None,
    block_tables: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """See pdserve.kernels.ops.prefill_attention."""
    config = choose_prefill_config(q.shape[2], q.device)
    return prefill_attention_with(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        k_cache,
        v_cache,
        block_tables,
        config,
        k_scale,
        v_scale,
    )
