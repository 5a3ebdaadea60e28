"""Ops that a compiled decode step (``services/engine/decode_graph.py``) sees as opaque calls.

Writing a token's K/V into the paged cache mutates a tensor the graph did not make. Traced as
plain indexing, AOTAutograd functionalizes that write into "clone the cache, scatter, copy it
back", which on the CPU copied every layer's whole cache on every step (measured: a 1456-block
SmolLM2 cache turned a 44 ms step into 500 ms). As a custom op that declares what it mutates,
Inductor calls it in place and orders the attention that reads the pages after it.

The write itself is the plain-torch twin's (``reference.store_kvcache``) without its check for
skipped slots: a compiled step has none (padding rows repeat a real row, and write the same
values to the same slot).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdserve.kernels.reference import store_kvcache


@torch.library.custom_op("pdserve::store_kv", mutates_args=("pages",))
def store_kv(key: Tensor, value: Tensor, pages: Tensor, slots: Tensor) -> None:
    """key/value [T, Hk, D] into one layer's float pages [blocks, 2, block_size, Hk, D] at
    ``slots`` [T]. One mutated input per layer: K and V as two inputs would alias (views of one
    storage), and AOTAutograd then handed the op stale values (measured: wrong K/V written)."""
    num_blocks, _, block_size, heads, dim = pages.shape
    width = heads * dim
    if pages.stride()[1:] != (block_size * width, width, dim, 1) or pages.stride(0) % width:
        store_kvcache(key, value, pages[:, 0], pages[:, 1], slots)
        return
    # each block's K then V rows are contiguous: one row view of the whole layer, written with
    # two index copies (the twin's checks and views cost ~10x more at decode sizes)
    per_block = pages.stride(0) // width
    rows = torch.as_strided(
        pages, ((num_blocks - 1) * per_block + 2 * block_size, width), (width, 1)
    )
    at = torch.div(slots, block_size, rounding_mode="floor") * per_block + slots % block_size
    rows.index_copy_(0, at, key.reshape(-1, width).to(pages.dtype))
    rows.index_copy_(0, at + block_size, value.reshape(-1, width).to(pages.dtype))


@store_kv.register_fake
def _store_kv_fake(key: Tensor, value: Tensor, pages: Tensor, slots: Tensor) -> None:
    return None


def store(key: Tensor, value: Tensor, pages: Tensor, slots: Tensor) -> None:
    """The compiled step's KV write (see ``ops.store_kvcache`` for the contract)."""
    torch.ops.pdserve.store_kv(key, value, pages, slots)
