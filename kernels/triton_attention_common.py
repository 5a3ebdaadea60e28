"""Pieces the attention kernels share: device facts, dot precision, paged-row addressing."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = math.log2(math.e)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter (CPU tensors) gets a small stand-in."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 on tensor cores would silently drop to tf32 (~1e-3 error); the engine runs bf16 on
    # GPUs, so fp32 is the "exact" mode and pays for IEEE dots.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def table_pages(block_table_row_ptr, tokens, valid, block_size: tl.constexpr):
    """The cache block (page) holding each of these token positions, read from the block table."""
    return tl.load(block_table_row_ptr + tokens // block_size, mask=valid, other=0).to(tl.int64)


@triton.jit
def page_rows(
    pages, tokens, kv_head, block_size: tl.constexpr, stride_block, stride_offset, stride_head
):
    """Element offsets of the rows (token, kv_head, :) of one strided paged view (values or
    scales: each has its own strides over the same pages)."""
    return (
        pages * stride_block
        + (tokens % block_size).to(tl.int64) * stride_offset
        + kv_head * stride_head
    )


@triton.jit
def cache_rows(
    table_row_ptr,
    tokens,
    valid,
    kv_head,
    block_size: tl.constexpr,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    KV_QUANT: tl.constexpr,
):
    """Element offsets of the rows (token, kv_head, :) of a strided paged-cache view, and of
    their scales in a quantized cache (the K and V views of one layer share their strides, and so
    do their scales); without scales the second is the first, never read. One page lookup serves
    both."""
    pages = table_pages(table_row_ptr, tokens, valid, block_size)
    rows = page_rows(
        pages,
        tokens,
        kv_head,
        block_size,
        stride_cache_block,
        stride_cache_offset,
        stride_cache_head,
    )
    if KV_QUANT:
        scale_rows = page_rows(
            pages,
            tokens,
            kv_head,
            block_size,
            stride_scale_block,
            stride_scale_offset,
            stride_scale_head,
        )
        return rows, scale_rows
    else:
        return rows, rows


@triton.jit
def key_rows(
    tokens,
    valid,
    kv_head,
    k_start,
    table_row_ptr,
    block_size: tl.constexpr,
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
    PAGED: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Prefill's element offsets of the K rows, the V rows and (quantized cache) the scales of
    these key positions, paged or packed; without scales the third is the first, never read."""
    if PAGED:
        rows, scale_rows = cache_rows(
            table_row_ptr,
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
        return rows, rows, scale_rows
    else:
        token = (k_start + tokens).to(tl.int64)
        k_rows = token * stride_k_token + kv_head * stride_k_head
        v_rows = token * stride_v_token + kv_head * stride_v_head
        return k_rows, v_rows, k_rows


def scale_strides(k_scale: Tensor | None, v_scale: Tensor | None) -> tuple[int, int, int]:
    """(block, offset, head) element strides of a quantized cache's k/v_scale views [blocks,
    block_size, Hk, 1] float32; zeros for a float cache (whose kernels never read them)."""
    if k_scale is None or v_scale is None:
        return (0, 0, 0)
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
    assert k_scale.stride() == v_scale.stride(), "K and V scale views must share one layout"
    return (k_scale.stride(0), k_scale.stride(1), k_scale.stride(2))
