"""CPU weights in transparent huge pages (issue 42).

A decode step streams every weight once, so its speed is the speed at which one core reads
memory. In 4 KiB pages that read misses the TLB every 4 KiB, and the hardware prefetchers stop at
each page's edge. Measured on issue 42's second CPU (Zen 4, one thread, SmolLM2-135M's 538 MB of
float32 weights): a plain sum read them at 21 GB/s from 4 KiB pages and at 28 GB/s from 2 MiB
ones, and the decode kernel's pass over them fell from 27.7 to 21.4 ms.

Linux backs anonymous memory with 2 MiB pages where a region asks for it (``MADV_HUGEPAGE``),
which is what the usual THP setting (``madvise``) waits for. torch's allocator never asks. So the
loaded weights move, storage by storage, into one region that does: same shapes, strides and
values, the old storage freed. Where THP is off (``never``) the region is ordinary memory, and
nothing else changes.
"""

from __future__ import annotations

import logging
import math
import mmap
from itertools import chain
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line
MIN_BYTES = 1 << 20  # smaller storages (norms, rotary tables) are not worth a copy
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's THP setting (``always``, ``madvise`` or ``never``), ``unknown`` where the
    file is absent (not Linux, or no THP)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def huge_region(nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """A zeroed anonymous mapping of at least ``nbytes`` that asks for huge pages, as a storage,
    and the byte offset in it where a 2 MiB-aligned span of ``nbytes`` starts."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP: EINVAL, and the region stays 4 KiB pages
            log.debug("madvise(MADV_HUGEPAGE) refused: weights stay in 4 KiB pages")
    # frombuffer keeps the mapping alive as long as the storage
    region = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -region.data_ptr() % HUGE_PAGE
    return region.untyped_storage(), start


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor in a region that asks for huge pages: the paged KV cache.

    Decode attention reads each sequence's blocks where the block manager put them, a run of a
    few KiB at a time anywhere in the cache. In 4 KiB pages every run costs TLB misses and starts
    the prefetchers cold on each page; measured on Zen 4 (perf/paged_decode_bench.py, batch
    16-64), the kernel read 12-14 GB/s from 4 KiB pages and 17-19 from 2 MiB ones on one core.
    The region's pages are touched only when written, as torch.zeros' are."""
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    region, start = huge_region(max(numel * itemsize, 1))
    flat = torch.empty(0, dtype=dtype).set_(region, start // itemsize, (numel,), (1,))
    return flat.view(shape)


def move_to_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move the CPU storages of ``model``'s parameters and buffers of at least ``min_bytes``
    into one huge-page region; returns the bytes moved. Tensors that share a storage (a tied
    LM head, views) still share it afterwards."""
    tensors = [
        t
        for t in chain(model.parameters(), model.buffers())
        if t.device.type == "cpu" and not t.is_quantized
    ]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() >= min_bytes:
            storages.setdefault(storage.data_ptr(), storage)
    if not storages:
        return 0
    offsets: dict[int, int] = {}
    total = 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    region, start = huge_region(total)
    for ptr, storage in storages.items():
        offsets[ptr] += start
        dst = torch.empty(0, dtype=torch.uint8)
        dst.set_(region, offsets[ptr], (storage.nbytes(),), (1,))
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    with torch.no_grad():
        for t in tensors:
            offset = offsets.get(t.untyped_storage().data_ptr())
            if offset is None:  # small, or already moved (a tensor listed twice)
                continue
            moved = torch.empty(0, dtype=t.dtype).set_(
                region, offset // t.element_size() + t.storage_offset(), t.size(), t.stride()
            )
            t.data = moved
    log.info(
        "weights: %.0f MiB moved to a huge-page region (THP: %s)", total / (1 << 20), thp_mode()
    )
    return total
