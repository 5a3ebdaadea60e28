"""How the prefill kernel is launched: its tiling, and where its keys come from (the packed k/v of
this forward pass or the paged cache, float or quantized) as the pointers and strides it takes.

Pure host-side bookkeeping (no Triton launch), kept apart from the kernel in triton_prefill.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.kernels.triton_attention_common import scale_strides


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # queries per program
    block_n: int  # keys per inner-loop tile
    num_warps: int = 4
    num_stages: int = 2


def choose_prefill_config(head_dim: int, device: torch.device) -> PrefillConfig:
    if device.type != "cuda":
        # Interpreter: big tiles mean fewer interpreted iterations.
        return PrefillConfig(block_m=64, block_n=64)
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class PrefillKeys:
    """The kernel's key/value operands. Pointers the chosen path never reads are stand-ins."""

    keys: Tensor  # packed k [T, Hk, D] or the paged K cache view
    values: Tensor
    k_scales: Tensor  # a quantized cache's scale views, else stand-ins
    v_scales: Tensor
    block_tables: Tensor  # [B, max_blocks] int32, or a stand-in when packed
    num_kv_heads: int
    block_size: int  # 1 when packed
    # packed k/v (token, head) x 2, table row, cache (block, offset, head), scales (same three)
    strides: tuple[int, ...]
    paged: bool
    quantized: bool


def prefill_keys(
    k: Tensor,
    v: Tensor,
    cu_seqlens_k: Tensor,
    k_cache: Tensor | None,
    v_cache: Tensor | None,
    block_tables: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> PrefillKeys:
    if block_tables is None:
        # A quantized cache is only ever read through its pages; packed k/v are the model's dtype.
        assert k_scale is None, "k/v_scale come with a paged (block_tables) prefill only"
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        packed = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        strides = (*packed, 0, 0, 0, 0, 0, 0, 0)
        return PrefillKeys(
            keys=k,
            values=v,
            k_scales=k,
            v_scales=v,
            block_tables=cu_seqlens_k,
            num_kv_heads=k.shape[1],
            block_size=1,
            strides=strides,
            paged=False,
            quantized=False,
        )
    assert k_cache is not None and v_cache is not None
    assert k_cache.stride() == v_cache.stride(), "K and V views must share one layout"
    assert block_tables.stride(-1) == 1 and k_cache.stride(-1) == 1
    quantized = k_scale is not None and v_scale is not None
    cache = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    strides = (0, 0, 0, 0, block_tables.stride(0), *cache, *scale_strides(k_scale, v_scale))
    return PrefillKeys(
        keys=k_cache,
        values=v_cache,
        k_scales=k_scale if quantized else k_cache,
        v_scales=v_scale if quantized else v_cache,
        block_tables=block_tables,
        num_kv_heads=k_cache.shape[2],
        block_size=k_cache.shape[1],
        strides=strides,
        paged=True,
        quantized=quantized,
    )
