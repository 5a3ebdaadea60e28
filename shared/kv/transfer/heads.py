"""The KV heads one rank's cache holds, and head slices of its blocks packed for the wire.

A cache's storage splits into *parts* (the float cache is its own single part; a quantized one
has values and scales), each ``[num_blocks, layers, 2, block_size, local_heads, X]``. A
head-sliced run travels as one message: for each part in order, ``part[run, :, :, :, a:b]``
made contiguous, flattened, concatenated. Parts are handled as byte views (the last dim times
the element size), so values and float32 scales pack alike and no segment needs alignment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

Split = Callable[[torch.Tensor], list[torch.Tensor]]
Heads = tuple[int, int]


class HeadSlicer:
    """Global KV heads ``[lo, hi)`` held by ``kv_cache``, and packing of head slices of its runs.

    ``heads`` None means every head of the fingerprint's ``num_kv_heads`` (TP 1); ``split`` None
    means the storage is its own single part."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        heads: Heads | None = None,
        split: Split | None = None,
    ) -> None:
        total = fingerprint.get("num_kv_heads")
        if split is None and kv_cache.dim() != 6:
            # opaque storage (a quantized cache given no split): whole-block pulls only
            if heads is not None or type(total) is not int:
                raise ValueError("a KV cache that is not [blocks, ..., heads, dim] needs split")
            self.heads: Heads = (0, total)
            self.total = total
            self.parts: list[torch.Tensor] | None = None
            return
        parts = list(split(kv_cache)) if split is not None else [kv_cache]
        if not parts or any(p.dim() != 6 or p.shape[0] != kv_cache.shape[0] for p in parts):
            raise ValueError("split must give parts shaped [blocks, layers, 2, block, heads, X]")
        local = parts[0].shape[4]
        if any(p.shape[4] != local for p in parts):
            raise ValueError("the parts of a KV cache disagree on its number of heads")
        total = local if total is None else total
        lo, hi = (0, total) if heads is None else heads
        if not 0 <= lo < hi <= total or hi - lo != local:
            raise ValueError(f"KV heads {heads} do not fit a cache of {local} of {total} heads")
        self.heads = (lo, hi)
        self.total = total
        # byte views: a head slice of any dtype is then a plain byte copy
        self.parts = [p.view(torch.uint8) for p in parts]

    @property
    def full(self) -> Heads:
        """Every head of the model: what a cache of TP 1 holds."""
        return (0, self.total)

    def requested(self, heads: object, whole: object) -> tuple[Heads, bool]:
        """Parse a pull request's ``heads`` and ``whole``, or raise ValueError with the reason.
        A request without them (an older puller) asks for every head, whole."""
        if heads is None and whole is None:
            heads, whole = list(self.full), True
        if type(heads) is tuple:  # as a version 3 request has them: two ints
            if heads == self.heads and type(whole) is bool and (whole or self.parts is not None):
                return heads, whole  # every head held here: what most pulls ask
            heads = list(heads)
        if (
            type(heads) is not list
            or len(heads) != 2
            or not all(type(h) is int for h in heads)
            or type(whole) is not bool
        ):
            raise ValueError("malformed heads")
        lo, hi = heads
        if not lo < hi:
            raise ValueError(f"empty KV head range [{lo}, {hi})")
        if not self.heads[0] <= lo < hi <= self.heads[1]:
            raise ValueError(f"KV heads [{lo}, {hi}) are not all held here {list(self.heads)}")
        if self.parts is None and not (whole and (lo, hi) == self.heads):
            raise ValueError("this KV cache cannot be head-sliced (no split given)")
        return (lo, hi), whole

    def _slices(self, start: int, count: int, heads: Heads) -> list[torch.Tensor]:
        if self.parts is None:
            raise ValueError("this KV cache cannot be head-sliced (no split given)")
        a, b = heads[0] - self.heads[0], heads[1] - self.heads[0]
        return [p[start : start + count, :, :, :, a:b] for p in self.parts]

    def pack(self, start: int, count: int, heads: Heads) -> tuple[torch.Tensor, bool]:
        """The message for a run: the cache's own memory when the slice is one contiguous piece,
        else a staging copy. Returns it and whether it was copied."""
        slices = self._slices(start, count, heads)
        if len(slices) == 1 and slices[0].is_contiguous():
            return slices[0], False
        staging = torch.empty(
            sum(s.numel() for s in slices), dtype=torch.uint8, device=slices[0].device
        )
        offset = 0
        for s in slices:
            staging[offset : offset + s.numel()].view(s.shape).copy_(s)
            offset += s.numel()
        return staging, True

    def landing(self, start: int, count: int, heads: Heads) -> tuple[torch.Tensor, bool]:
        """Where a run's message is received: the destination itself when it is one contiguous
        piece, else a staging buffer for ``unpack``. Returns it and whether it is staging."""
        slices = self._slices(start, count, heads)
        if len(slices) == 1 and slices[0].is_contiguous():
            return slices[0], False
        size = sum(s.numel() for s in slices)
        return torch.empty(size, dtype=torch.uint8, device=slices[0].device), True

    def unpack(self, staging: torch.Tensor, start: int, count: int, heads: Heads) -> None:
        """Copy a received staging buffer into the head slice of blocks ``[start, start+count)``."""
        offset = 0
        for s in self._slices(start, count, heads):
            s.copy_(staging[offset : offset + s.numel()].view(s.shape))
            offset += s.numel()


async def settle(tensors: list[torch.Tensor]) -> None:
    """Wait until the copies queued so far on the tensors' CUDA devices are done (UCX sends from
    or hands out memory our stream may still be writing), without blocking the event loop."""
    devices = {t.device for t in tensors if t.is_cuda}
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        await asyncio.to_thread(event.synchronize)
