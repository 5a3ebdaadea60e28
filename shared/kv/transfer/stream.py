"""Layer-wise streaming of a prefill's KV (issue 29 item 3): a lease whose blocks are still being
computed, and pulls of one layer group of its blocks that the server answers once prefill has
written those layers.

The prefill worker leases a long prompt's blocks as soon as the forward pass that completes its
prompt starts (every earlier chunk is in the cache by then; the block table is final), with a
``LayerStream``: the engine reports each layer group as the pass writes it (``advance``), and
the end of the pass with the sampled first token (``finish``), or that the prompt will never be
complete (``end``: finished at its first token, aborted, failed). A decode worker pulls the
lease as a few *pieces*, one per layer group, all asked at once: the server holds a piece's
request until its layers are written, then sends it like any pull. The last piece (``final``)
also waits for the first token, which its reply carries, so the decode worker gets KV and token
from the pull alone. A piece's message is one per (block, part): ``part[block, lo:hi]`` is a
contiguous range of a block-major cache, so nothing is packed or staged.

Pieces move whole blocks only: both ends hold the same KV heads (equal TP sizes) and the
storage's parts are known (``heads.HeadSlicer``). Checksums are taken when a lease is added, so
a streamed lease has none: ``--kv-checksum`` pulls in bulk.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.shared.kv.transfer.wire import KVTransferError, TransferStats, buffer


class KVStreamFinished(KVTransferError):
    """A streamed lease's request finished at its first token: its prompt's KV never completes
    (the gateway has the answer; the decode worker drops the request)."""


# A refusal's reason when the prompt will never be complete because its request finished at the
# first token (EOS, max_tokens 1): the decode worker drops the request quietly, the gateway has
# its answer already.
FINISHED = "finished at its first token"

Layers = tuple[int, int]


@dataclass
class LayerStream:
    """How far the prefill of a streamed lease has written its blocks: every layer below
    ``ready_layers`` holds all of the prompt's tokens. Used from the server's event loop; the
    engine thread reaches it through ``call_soon_threadsafe``. The prefill side's
    ``KVLayerFeed`` (``shared/kv/contract.py``)."""

    num_layers: int
    ready_layers: int = 0
    first_token: int | None = None
    complete: bool = False  # the pass is over and the first token sampled
    ended: str | None = None  # why it never will be (the pieces still waiting are refused)
    # CUDA: an event recorded after the last layer group written; a send waits for it
    event: Any = None
    # blocks complete in every layer when leased (earlier chunks, a cached prefix): a piece
    # of only these goes at once
    done_blocks: frozenset[int] = frozenset()
    waiters: list[Callable[[], None]] = field(default_factory=list)

    def ready(self, layers: Layers, final: bool, done: bool = False) -> bool:
        """Whether a piece can go (``done``: all its blocks are in ``done_blocks``)."""
        if self.complete:
            return True
        return not final and (done or self.ready_layers >= layers[1])

    def advance(self, layers: int, event: Any = None) -> None:
        if self.complete or self.ended is not None or layers <= self.ready_layers:
            return
        self.ready_layers = min(layers, self.num_layers)
        self.event = event if event is not None else self.event
        self._notify()

    def finish(self, first_token: int, event: Any = None) -> None:
        if self.complete or self.ended is not None:
            return
        self.ready_layers, self.first_token, self.complete = self.num_layers, first_token, True
        self.event = event if event is not None else self.event
        self._notify()

    def end(self, reason: str) -> None:
        if self.complete or self.ended is not None:
            return
        self.ended = reason
        self._notify()

    def _notify(self) -> None:
        waiters, self.waiters = self.waiters, []
        for wake in waiters:
            wake()


# --kv-stream-threshold -1 on a GPU. SGLang's measurements put the break-even between 256 tokens
# (+18% TTFT) and 1K (-61%); on CPUs it never paid here (perf/README.md, issue 29 item 3).
AUTO_THRESHOLD_CUDA = 1024


def stream_threshold(value: int, device_type: str) -> int:
    """The prompt length from which KV streams: ``--kv-stream-threshold``, or for -1 (auto)
    ``AUTO_THRESHOLD_CUDA`` on CUDA and off (0) elsewhere."""
    if value >= 0:
        return value
    return AUTO_THRESHOLD_CUDA if device_type == "cuda" else 0


def can_stream(threshold: int, checksum: bool, one_rank: bool, views: LayerViews | None) -> bool:
    """Whether a worker streams (``--kv-stream-threshold`` > 0): one rank (a TP worker's other
    ranks hear of no layers, and pull in bulk), whole blocks of known parts (``views``), and no
    ``--kv-checksum`` (hashes are taken when a lease is added; a streamed lease is unwritten)."""
    return threshold > 0 and one_rank and not checksum and views is not None


def when_ready(
    lease: Any, ready: Callable[[], bool], go: Callable[[], None], refuse: Callable[[str], None]
) -> None:
    """Call ``go`` once ``ready()`` holds for ``lease`` (a streamed one), or ``refuse`` with
    the reason once it never will: the prompt ended unfinished, or the lease was let go."""
    stream = lease.stream
    done = False

    def wake() -> None:
        nonlocal done
        if done:
            return
        if lease.dropped or stream.ended is not None:
            why = (
                stream.ended
                if stream.ended == FINISHED
                else (
                    f"prefill of {lease.bus_id} "
                    + (f"ended: {stream.ended}" if stream.ended else "was let go")
                )
            )
            done = True
            refuse(why)
        elif ready():
            done = True
            go()
        else:
            stream.waiters.append(wake)
            return
        with contextlib.suppress(ValueError):
            lease.on_drop.remove(wake)

    stream.waiters.append(wake)
    lease.on_drop.append(wake)


def layer_groups(num_layers: int, groups: int) -> list[Layers]:
    """``groups`` consecutive layer ranges covering ``[0, num_layers)``, as even as they come."""
    groups = max(1, min(groups, num_layers))
    bounds = [round(i * num_layers / groups) for i in range(groups + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(groups)]


def plan(
    num_layers: int, groups: int, ready_blocks: int, num_blocks: int
) -> list[tuple[Layers, tuple[int, int]]]:
    """A streamed pull's pieces, (layers, block positions): the blocks complete when leased
    (``ready_blocks``) in every layer, ready at once; then the rest, one piece per layer group
    as the pass writes it, the last also waiting for the first token."""
    head = min(ready_blocks, num_blocks - 1)  # the pass writes at least the last block
    tail = [(g, (head, num_blocks)) for g in layer_groups(num_layers, groups)]
    return ([((0, num_layers), (0, head))] if head > 0 else []) + tail


def parse_layers(layers: Layers | None, final: bool, num_layers: int) -> tuple[Layers, bool] | None:
    """A pull request's layer range and ``final`` flag (None: a bulk pull), or ValueError."""
    if layers is None:
        return None
    lo, hi = layers
    if not 0 <= lo < hi <= num_layers:
        raise ValueError(f"layers [{lo}, {hi}) are not within the model's {num_layers}")
    return (lo, hi), final


class LayerViews:
    """Byte views of ``part[block, lo:hi]`` for each block of some runs and each part of a
    block-major cache (``parts``: ``HeadSlicer.parts``, byte views ``[blocks, layers, ...]``)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.num_layers = parts[0].shape[1]
        one = len(parts) == 1 and not parts[0].is_cuda and parts[0].is_contiguous()
        # a plain CPU cache: numpy slices of one flat view (~0.3 us each, a torch slice ~3 us)
        self.flat: np.ndarray | None = buffer(parts[0]) if one else None
        self.block = parts[0][0].numel() if one else 0
        self.layer = self.block // self.num_layers if one else 0

    def of(self, runs: list[tuple[int, int]], layers: Layers) -> list[Any]:
        lo, hi = layers
        if self.flat is not None:
            b, step = self.block, self.layer
            return [
                self.flat[k * b + lo * step : k * b + hi * step]
                for start, count in runs
                for k in range(start, start + count)
            ]
        views = []
        for start, count in runs:
            for k in range(start, start + count):
                for part in self.parts:
                    piece = part[k, lo:hi]
                    if not piece.is_contiguous():
                        raise ValueError("a layer range of this cache is not contiguous")
                    views.append(buffer(piece))
        return views

    def count(self, runs: list[tuple[int, int]]) -> int:
        """How many messages ``of`` gives for ``runs`` (a refusal completes that many)."""
        return sum(count for _, count in runs) * len(self.parts)


async def pull_streamed(
    client: Any,
    bus_id: str,
    handle: Any,
    dst_block_ids: list[int],
    timeout: float,
    groups: int,
    stall: float | None = None,
) -> TransferStats:
    """Pull a streamed lease as ``groups`` layer groups, all asked at once: the server sends
    each as prefill writes it, the last with the first token (``client``: a KVClient). Raises
    KVStreamFinished when the request ended at its first token, KVTransferError when no piece
    arrives for ``stall`` seconds (its prefill worker died or hangs: only pieces show that it
    lives, and the whole pull may wait for ``timeout``, the request's deadline)."""
    num_layers = client.layer_views.num_layers if client.layer_views else 1
    pieces = plan(
        num_layers, groups, handle.ready_blocks, -(-handle.num_tokens // client.block_size)
    )
    t0 = time.perf_counter()
    done_at: list[float] = [0.0] * len(pieces)

    async def one(i: int) -> TransferStats:
        layers, span = pieces[i]
        last = i == len(pieces) - 1
        stats = await client.pull(
            bus_id, handle, dst_block_ids, timeout, layers=layers, final=last, span=span
        )
        done_at[i] = time.perf_counter() - t0
        return stats

    results = await _unless_stalled(
        [asyncio.ensure_future(one(i)) for i in range(len(pieces))], stall
    )
    if results is None:
        raise KVTransferError(f"streamed KV pull from {handle.worker_id} got no piece for {stall}s")
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        errors.sort(key=lambda e: not isinstance(e, KVStreamFinished))  # why, if it is so
        raise errors[0]
    total = TransferStats(
        num_bytes=sum(r.num_bytes for r in results),
        num_blocks=results[0].num_blocks,
        num_messages=sum(r.num_messages for r in results),
        seconds=time.perf_counter() - t0,
        first_token=results[-1].first_token,
    )
    total.piece_seconds = done_at
    if total.first_token is None:
        raise KVTransferError(f"{handle.worker_id} sent no first token with the last piece")
    return total


async def _unless_stalled(tasks: list[asyncio.Future], stall: float | None) -> list | None:
    """Every task's result or exception, or None - every task cancelled and awaited (a pull's
    cancel aborts its receives: nothing lands in the blocks after) - once ``stall`` seconds
    pass with none of them done."""
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(
                pending, timeout=stall, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if pending:
        return None
    return [t.exception() if t.exception() is not None else t.result() for t in tasks]
