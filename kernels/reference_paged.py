"""What the plain-torch twins share: their compute dtype and fast views and gathers of a paged cache.

A paged cache is [num_blocks, block_size, Hk, D], usually the strided per-layer view
``kv_cache[:, layer, 0]`` of the engine's one cache tensor; nothing here copies it whole.
"""

from __future__ import annotations

import torch
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
