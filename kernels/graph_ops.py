"""Ops that a compiled decode step (``services/engine/decode_graph.py``) sees as opaque calls.

Writing a token's K/V into the paged cache mutates a tensor the graph did not make. Traced as
plain indexing, AOTAutograd functionalizes that write into "clone the cache, scatter, copy it
back", which on the CPU copied every layer's whole cache on every step (measured: a 1456-block
SmolLM2 cache turned a 44 ms step into 500 ms). As an op that declares what it mutates, Inductor
calls it in place and orders the attention that reads the pages after it.

The op takes one layer's pages as one tensor (K and V as two inputs would alias, views of one
storage, and AOTAutograd then handed the op stale values: wrong K/V written), and the rows to
write, computed once per step for every layer (``kv_rows``). It is registered through
``torch.library.Library`` rather than ``custom_op``: 3 us a call against 16 us, 30 calls a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define("store_kv_rows(Tensor key, Tensor value, Tensor(a!) pages, Tensor rows) -> ()")


def kv_rows(pages: Tensor, slots: Tensor) -> Tensor:
    """[2, T] rows of ``token_view(pages)`` where each slot's K (row 0) and V (row 1) go; the
    same for every layer of one cache (their pages have the same strides)."""
    width = pages.shape[3] * pages.shape[4]
    block_size = pages.shape[2]
    at = torch.div(slots, block_size, rounding_mode="floor") * (pages.stride(0) // width)
    at = at + slots % block_size
    return torch.stack((at, at + block_size))


def fits(pages: Tensor) -> bool:
    """Whether each block's K rows then V rows are one contiguous run, as in the engine's
    block-major float cache: what ``kv_rows`` and the row view assume."""
    _, _, block_size, heads, dim = pages.shape
    width = heads * dim
    return (
        pages.stride()[1:] == (block_size * width, width, dim, 1) and pages.stride(0) % width == 0
    )


def _store_kv_rows(key: Tensor, value: Tensor, pages: Tensor, rows: Tensor) -> None:
    num_blocks, _, block_size, heads, dim = pages.shape
    width = heads * dim
    per_block = pages.stride(0) // width
    view = torch.as_strided(
        pages, ((num_blocks - 1) * per_block + 2 * block_size, width), (width, 1)
    )
    source = torch.cat((key.reshape(-1, width), value.reshape(-1, width))).to(pages.dtype)
    view.index_copy_(0, rows.reshape(-1), source)


_LIB.impl("store_kv_rows", _store_kv_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::store_kv_rows")
def _store_kv_rows_fake(key: Tensor, value: Tensor, pages: Tensor, rows: Tensor) -> None:
    return None


def store(key: Tensor, value: Tensor, pages: Tensor, rows: Tensor) -> None:
    """key/value [T, Hk, D] into one layer's float pages [blocks, 2, block_size, Hk, D] at
    ``rows`` (``kv_rows`` of the step's slots)."""
    torch.ops.pdserve.store_kv_rows(key, value, pages, rows)
