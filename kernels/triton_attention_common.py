"""Pieces both attention kernels share: device facts and dot precision."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

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
def paged_rows(
    block_table_row_ptr,
    tokens,
    valid,
    kv_head,
    block_size: tl.constexpr,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
):
    """Element offsets of the rows (token, kv_head, :) of a strided paged-cache view.

    block_size is a compile-time constant (one per engine), so the divisions become shifts.
    """
    page = tl.load(block_table_row_ptr + tokens // block_size, mask=valid, other=0).to(tl.int64)
    return (
        page * stride_cache_block
        + (tokens % block_size).to(tl.int64) * stride_cache_offset
        + kv_head * stride_cache_head
    )
