"""Paged decode attention that reads the KV pages in place: for the compiled CPU decode step.

Where the C++ extension builds (an AVX2 CPU), the engine's compiled step calls its kernel instead
(``cpu_gemv.paged_attention``, ``cpu_attention.cpp``: 1.3x this form at batch 16-64); this form
serves elsewhere, and quantized caches' math is its reference.

One query per sequence over its cached tokens, written in plain torch ops so that it

- runs eagerly (correct; the gather then materializes each sequence's pages, any speed), and
- traces with ``torch.compile(fullgraph=True)`` without a graph break or a host sync: no
  ``.item()``, no ``bool()`` of a tensor, no data-dependent shape. The number of blocks per table
  may be a dynamic dimension (``torch._dynamo.mark_dynamic(block_tables, 1)``); one graph per
  batch bucket then serves every context length.

Under Inductor (CPU) the page gather ``cache[table]`` is an indirect load inside the loops that
consume it, never a buffer: the score reduction reads K, and the weighted sum reads V, straight
from the pages of the (strided, per-layer) cache view. What is materialized is small: the scores
[B, nb, bs, Hk, G] (G / (2*D) of the K/V bytes) and one partial output per block [B, nb, Hk, G, D]
(G / bs of the V bytes).

Why this shape of computation (measured on a shared 2-core AVX2 EPYC VM, SmolLM2's 9/3 heads,
D 64, block 16, fp32; perf/paged_decode_bench.py):

- Two passes, with the softmax over all positions in between (scores -> max -> exp -> sum ->
  weighted V), not an online softmax per block: Inductor does not fuse a per-block max, exp and
  V sum into the score loop (its outer-loop fusion needs matching loop prefixes, which these
  reductions do not have), so "flash" partials only add passes. The softmax passes over the
  small score buffer cost ~20% of the compute: rows of Hk*G = 9 vectorize as 8 lanes plus a tail.
- V is summed per block first ([B, nb, Hk, G, D] partials), then over blocks. One reduction over
  all nb*bs positions makes Inductor sweep each sequence's V once per (head, 8 lanes of D),
  strided: 1.5-4x slower. Within a block the 16 rows stay in L1 across those sweeps.
- Both passes are bound by memory latency more than bandwidth: a page is a 12 KiB run, pages
  are scattered (and interleaved with the other layers' pages), so the hardware prefetcher
  restarts at every page. A bare sum over the same scattered pages reaches only ~60% of a
  contiguous sum's bandwidth on one core; with the dot products in the loop, fewer misses fit in
  flight. Threads add misses in flight; for batch 1 Inductor parallelizes over blocks, which is
  what flash-decoding's split buys on a GPU.
- Table slots past a sequence's last block are redirected to block 0: they are masked anyway, and
  all of them then hit one page in cache instead of fetching stale pages from memory (a padded
  batch row, context 0, costs next to nothing).

The query's own K/V is already stored in the cache (context_lens counts it). Output rows with
context 0 are zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Floor for the row max: a row with every position masked (context 0) has max -inf, and
# exp(-inf - -inf) would be NaN; with this floor its weights are exp(-inf) = 0 and its output 0.
_MAX_FLOOR = -1e30


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Paged GQA decode attention, one query per sequence; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hk, D], any strides (e.g. the
    per-layer view ``kv_cache[:, layer, 0]``), Hq a multiple of Hk; block_tables [B, max_blocks]
    int32/int64 (slots past a sequence's end may hold anything: they are clamped and masked);
    context_lens [B] cached tokens per sequence, the new one included (0: a padding row, zeros
    out). A quantized cache (int8, float8_e4m3fn) comes with k_scale / v_scale [num_blocks,
    block_size, Hk, 1] float32: value * scale is the float vector. Math in fp32 at least (fp64
    stays fp64).
    """
    batch, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    table_blocks = block_tables.shape[1]
    cdt = torch.promote_types(q.dtype, torch.float32)
    if batch == 0 or table_blocks == 0:  # shapes, not data: no guard on a dynamic dimension
        return q.new_zeros(q.shape)

    lens = context_lens.to(torch.int64).view(batch, 1)
    positions = torch.arange(table_blocks * block_size, device=q.device)
    valid = (positions.view(1, -1) < lens).view(batch, table_blocks, block_size, 1, 1)
    table = _page_ids(block_tables, lens, num_blocks, block_size)

    # Scores [B, nb, bs, Hk, G]: each cached K row against the G query heads that share its KV
    # head. The gather stays lazy, so the reduction over D loads K from the page itself.
    page_rows = (batch, table_blocks, block_size, num_kv_heads, 1, head_dim)
    keys = _gather(k_cache, table).view(page_rows)
    queries = q.to(cdt).reshape(batch, 1, 1, num_kv_heads, group, head_dim)
    scores = (queries * keys.to(cdt)).sum(-1)
    if k_scale is not None:  # per token-head scale: factors out of the dot product
        scores = scores * _gather(k_scale, table).view(scores.shape[:4] + (1,)).to(cdt)
    scores = (scores * scale).masked_fill(~valid, float("-inf"))

    # Softmax over every position of the sequence, per query head.
    row_max = scores.amax(dim=(1, 2), keepdim=True).clamp(min=_MAX_FLOOR)
    weights = torch.exp(scores - row_max)
    # >= 1 wherever a position is valid (the max contributes exp(0)); 0 only for context 0
    denom = weights.sum(dim=(1, 2)).clamp(min=1.0)  # [B, Hk, G]
    if v_scale is not None:  # fold V's per token-head scale into the weights
        weights = weights * _gather(v_scale, table).view(weights.shape[:4] + (1,)).to(cdt)

    # Weighted V: per block first (its 16 rows stay in L1 across the per-head sweeps), then
    # across blocks.
    values = _gather(v_cache, table).view(page_rows)
    per_block = (weights.unsqueeze(-1) * values.to(cdt)).sum(2)  # [B, nb, Hk, G, D]
    out = per_block.sum(1) / denom.unsqueeze(-1)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _page_ids(block_tables: Tensor, lens: Tensor, num_blocks: int, block_size: int) -> Tensor:
    """[B, nb] int64 block ids to read: the table's, clamped into the cache, and block 0 for
    every slot past the sequence's last block (masked anyway; one hot page instead of many)."""
    table = block_tables.to(torch.int64).clamp(0, num_blocks - 1)
    first_token = torch.arange(block_tables.shape[1], device=table.device).view(1, -1) * block_size
    return torch.where(first_token < lens, table, 0)


def _gather(cache: Tensor, table: Tensor) -> Tensor:
    """cache[table]: [B, nb, *cache.shape[1:]], lazy under Inductor (an indirect load in the
    consuming loop). ``_unsafe_index`` because the ids are already clamped: plain indexing would
    add a bounds check to every inner-loop load."""
    return torch.ops.aten._unsafe_index(cache, [table])
