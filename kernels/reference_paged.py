"""Plain-torch twins over a paged cache: what they share (their compute dtype, fast views and
gathers of a paged cache) and paged decode attention.

A paged cache is [num_blocks, block_size, Hk, D], usually the strided per-layer view
``kv_cache[:, layer, 0]`` of the engine's one cache tensor; nothing here copies it whole.

Paged decode attention: a few query tokens per sequence over its pages.

A plain decode step brings one query per sequence. A speculative verification step brings
1 + k_i per sequence (the last token and k_i proposals, their K/V already stored), packed into
q [T, Hq, D] by ``cu_seqlens_q``; query j of sequence i sits at position
context_lens[i] - q_len_i + j and sees the keys up to it. Vectorised over the batch: a constant
number of length groups, never a loop over sequences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, fp64 stays fp64: the precision every kernel accumulates in."""
    return torch.promote_types(dtype, torch.float32)


def contiguous_blocks(cache: Tensor) -> bool:
    """Whether each block of ``cache`` [num_blocks, block_size, Hk, D] is one contiguous run."""
    _, _, heads, dim = cache.shape
    _, s_tok, s_head, s_dim = cache.stride()
    return s_dim == 1 and s_head == dim and s_tok == heads * dim


def token_rows(cache: Tensor) -> tuple[Tensor, int] | None:
    """A [rows, Hk*D] view of a paged cache whose blocks keep (block_size, Hk, D) contiguous.

    Row ``block * per_block + offset`` is that token's slot, in the block-major layout as in a
    plain contiguous one. Single-index copies and gathers on this view are far faster on CPU than
    two-index advanced indexing through the strided per-layer view.
    """
    num_blocks, block_size, _, _ = cache.shape
    s_block, s_tok = cache.stride()[:2]
    if num_blocks == 0 or not contiguous_blocks(cache) or s_block % s_tok:
        return None
    per_block = s_block // s_tok
    rows = (num_blocks - 1) * per_block + block_size
    return torch.as_strided(cache, (rows, s_tok), (s_tok, 1)), per_block


def block_rows(cache: Tensor) -> Tensor | None:
    """A [num_blocks, block_size*Hk*D] view: one row per block. Gathering whole blocks (one
    contiguous 2-32 KiB row each) with ``index_select`` is about twice as fast on CPU as
    gathering token rows."""
    num_blocks, block_size, heads, dim = cache.shape
    if not contiguous_blocks(cache):
        return None
    return torch.as_strided(cache, (num_blocks, block_size * heads * dim), (cache.stride(0), 1))


def gather_paged(cache: Tensor, block_tables: Tensor, num_blocks: int) -> Tensor:
    """[B, num_blocks*block_size, Hk, D] copy of each sequence's first num_blocks cache blocks."""
    table = clamped_table(cache, block_tables, num_blocks)
    return gather_blocks(cache, table)


def gather_blocks(cache: Tensor, table: Tensor) -> Tensor:
    """[B, num_blocks*block_size, Hk, D] copy of the blocks ``table`` [B, num_blocks] names."""
    shape = (table.shape[0], table.shape[1] * cache.shape[1], *cache.shape[2:])
    rows = block_rows(cache)
    if rows is not None:
        return rows.index_select(0, table.reshape(-1)).view(shape)
    return cache[table].reshape(shape)


def clamped_table(cache: Tensor, block_tables: Tensor, num_blocks: int) -> Tensor:
    # Table slots past a sequence's end may hold padding (-1, stale ids); they are masked later,
    # but must still index something real.
    return block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)


DECODE_LENGTH_GROUPS = 8


class DecodePlan:
    """What every layer's decode attention shares within one forward pass: the length groups,
    each group's gather indices and masks. ``pdserve.kernels.ops.decode_plan`` makes one per step and
    the model passes it to every layer, so this work runs once, not once per layer.

    Sequences are sorted by context length and cut into ``DECODE_LENGTH_GROUPS`` groups, each
    padded only to its own longest context: gathering pages is the cost on CPU, and one padded
    gather would pay for the longest context in the batch. A constant number of groups, not a
    loop over sequences. With several queries per sequence each group also pads its queries to
    its own longest q_len.
    """

    def __init__(
        self,
        block_tables: Tensor,
        context_lens: Tensor,
        cu_seqlens_q: Tensor | None = None,
        max_seqlen_q: int = 1,
    ) -> None:
        self.block_tables = block_tables
        self.context_lens = context_lens
        # max_seqlen_q 1 is one query per sequence whatever cu_seqlens_q says: the plain path.
        multi = cu_seqlens_q is not None and max_seqlen_q > 1
        self.cu_seqlens_q = cu_seqlens_q if multi else None
        self.max_seqlen_q = max_seqlen_q if multi else 1
        self._groups: list[_DecodeGroup] | None = None
        self._geometry: tuple[int, ...] | None = None

    def groups(self, cache: Tensor, heads_per_kv: int = 1) -> list[_DecodeGroup]:
        # block ids are clamped to the cache and padded to its block size, and multi-query
        # masks have one row per (query, head of the kv group): other caches or models differ
        geometry = (*cache.shape[:2], heads_per_kv if self.cu_seqlens_q is not None else 0)
        if self._groups is None or geometry != self._geometry:
            self._groups = self._plan(cache, heads_per_kv)
            self._geometry = geometry
        return self._groups

    def _plan(self, cache: Tensor, heads_per_kv: int) -> list[_DecodeGroup]:
        lens = self.context_lens
        batch, block_size = lens.shape[0], cache.shape[1]
        count = min(DECODE_LENGTH_GROUPS, batch)
        members = [None] if count == 1 else list(torch.argsort(lens).tensor_split(count))
        groups = []
        for member in members:
            glens = lens if member is None else lens[member]
            tables = self.block_tables if member is None else self.block_tables[member]
            num_blocks = max(1, -(-int(glens.max()) // block_size))
            table = clamped_table(cache, tables, num_blocks)
            token = torch.arange(num_blocks * block_size, device=lens.device)
            valid = token[None, :] < glens[:, None].to(token.dtype)  # [b, S]
            empty = None if bool((glens > 0).all()) else (glens == 0).view(-1, 1, 1, 1)
            if self.cu_seqlens_q is None:
                groups.append(_DecodeGroup(member, table, valid[:, None, None, :], empty))
            else:
                groups.append(
                    self._query_group(member, glens, table, token, valid, empty, heads_per_kv)
                )
        return groups

    def _query_group(
        self,
        member: Tensor | None,
        glens: Tensor,
        table: Tensor,
        token: Tensor,
        valid: Tensor,
        empty: Tensor | None,
        heads_per_kv: int,
    ) -> _DecodeGroup:
        cu = self.cu_seqlens_q.long()
        starts, q_lens = cu[:-1], cu[1:] - cu[:-1]
        if member is not None:
            starts, q_lens = starts[member], q_lens[member]
        width = max(1, int(q_lens.max()))  # this group's longest q_len
        j = torch.arange(width, device=cu.device)
        real = j[None, :] < q_lens[:, None]  # [b, width]
        rows = starts[:, None] + j[None, :]
        # A padding query re-reads its sequence's first one; its output is never kept.
        q_rows = torch.where(real, rows, starts[:, None])
        if width == 1:  # one query each: the last position sees all it could, plain decode
            mask = valid[:, None, None, :]
        else:
            # query j at context_len - q_len + j; padding rows sit past the end and see every
            # valid key, so no row is all-masked (no NaN) unless the context is empty
            pos = (glens.long() - q_lens)[:, None] + j[None, :]
            allowed = valid[:, None, :] & (token[None, None, :] <= pos[:, :, None])
            # attention rows are (query, head of the kv group), queries outermost
            mask = allowed.repeat_interleave(heads_per_kv, dim=1)[:, None]  # [b, 1, w*g, S]
        return _DecodeGroup(
            member,
            table,
            mask,
            empty,
            q_rows=q_rows,
            kept=real.reshape(-1).nonzero().squeeze(1),
            out_rows=rows[real],
        )


class _DecodeGroup(NamedTuple):
    members: Tensor | None  # rows of the batch; None: all of them
    table: Tensor  # [b, num_blocks] block ids, clamped
    mask: Tensor  # [b, 1, rows, S] keys each attention row may see (rows broadcast if 1)
    empty: Tensor | None  # [b, 1, 1, 1] sequences with no context (their output is zeros)
    # several queries per sequence only (None: one query per sequence, q row = batch row)
    q_rows: Tensor | None = None  # [b, width] q row of each (sequence, query), padded
    kept: Tensor | None = None  # [n] which of the b*width padded rows are real queries
    out_rows: Tensor | None = None  # [n] their packed token rows, in the same order


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    cu_seqlens_q: Tensor | None = None,
    max_seqlen_q: int = 1,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Paged decode attention; see pdserve.kernels.ops.decode_attention for the contract.

    ``plan`` (from ``pdserve.kernels.ops.decode_plan`` for these tables, lengths and queries) skips
    re-planning.
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    if plan is None:
        plan = DecodePlan(block_tables, context_lens, cu_seqlens_q, max_seqlen_q)
    multi = cu_seqlens_q is not None and max_seqlen_q > 1
    if multi != (plan.cu_seqlens_q is not None):
        raise ValueError("decode plan made for another query layout (cu_seqlens_q/max_seqlen_q)")
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    groups = plan.groups(k_cache, num_q_heads // num_kv_heads)
    if not multi and len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, groups[0], scale, k_scale, v_scale)
    out = q.new_empty(q.shape)
    for group in groups:
        if multi:
            attn = _decode_group(q[group.q_rows], k_cache, v_cache, group, scale, k_scale, v_scale)
            out.index_copy_(0, group.out_rows, attn.index_select(0, group.kept))
        else:
            out[group.members] = _decode_group(
                q[group.members], k_cache, v_cache, group, scale, k_scale, v_scale
            )
    return out


def _decode_group(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    group: _DecodeGroup,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """q [b, Hq, D] (one query per sequence) or [b, width, Hq, D] -> [b or b*width, Hq, D]."""
    batch, width = q.shape[0], q.shape[1] if q.dim() == 4 else 1
    num_q_heads, head_dim = q.shape[-2:]
    num_kv_heads = k_cache.shape[2]
    heads_per_kv = num_q_heads // num_kv_heads
    cdt = compute_dtype(q.dtype)
    keys = gather_blocks(k_cache, group.table).to(cdt)  # [b, S, Hk, D]
    values = gather_blocks(v_cache, group.table).to(cdt)
    if k_scale is not None and v_scale is not None:  # a quantized cache: values * scales
        keys = keys * gather_blocks(k_scale, group.table)
        values = values * gather_blocks(v_scale, group.table)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [b, Hk, S, D]
    # GQA without repeating K/V: the query heads of one kv head (times the queries of the
    # sequence) act as rows that all read the same keys; the mask makes them causal.
    qg = q.to(cdt).reshape(batch, width, num_kv_heads, heads_per_kv, head_dim)
    qg = qg.transpose(1, 2).reshape(batch, num_kv_heads, width * heads_per_kv, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask, scale=scale)
    if group.empty is not None:  # an empty context has nothing to attend: zeros, not NaN
        out = out.masked_fill(group.empty, 0.0)
    out = out.reshape(batch, num_kv_heads, width, heads_per_kv, head_dim).transpose(1, 2)
    return out.reshape(batch * width, num_q_heads, head_dim).to(q.dtype)
