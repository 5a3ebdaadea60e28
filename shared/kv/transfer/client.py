"""The decode side: pulls a KV handle's blocks straight into blocks of its own cache."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from pdserve.shared.bus.protocol import KVHandle
from pdserve.shared.kv import ucx_config, ucx_progress
from pdserve.shared.kv.tp_layout import without_tp
from pdserve.shared.kv.transfer.checksum import KVChecksumError, KVHasher
from pdserve.shared.kv.transfer.heads import Heads, HeadSlicer, Split, settle
from pdserve.shared.kv.transfer.wire import (
    MAX_CONTROL_BYTES,
    REPLY_BYTES,
    Endpoints,
    FingerprintMismatch,
    KVTransferError,
    TransferStats,
    block_runs,
    blocks_for_tokens,
    buffer,
    fingerprint_diff,
    own_address,
    parse_address,
    pull_tag,
    reply_sliced,
    reply_sums,
    retrieve,
    unpack_reply,
)

log = logging.getLogger("pdserve.kv")


@dataclass
class _Pull:
    ep: Any
    # the server said yes, so KV is headed our way on this endpoint (and, once receives are
    # posted, into our blocks): until all of it is in, only aborting the endpoint stops it
    incoming: bool = False


class KVClient:
    """Pulls KV handles into ``kv_cache``; keeps one endpoint per prefill worker.

    ``heads``: the global KV heads ``(lo, hi)`` this rank's cache holds (None: all of the
    fingerprint's ``num_kv_heads``, TP 1). ``split``: the storage's parts, each ``[n, layers, 2,
    block_size, heads, X]`` (None: the storage is its one part) - see ``heads.HeadSlicer``.
    ``checksum``: verify every pull against the server's hashes (``--kv-checksum``,
    ``checksum.py``); a mismatch raises KVChecksumError."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        block_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        heads: Heads | None = None,
        split: Split | None = None,
        checksum: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        self.slicer = HeadSlicer(kv_cache, fingerprint, heads, split)
        self.hasher = KVHasher(kv_cache, self.slicer)
        self.checksum = checksum
        self.fingerprint = dict(fingerprint)
        self.block_size = block_size
        self.host = host
        self.port = port
        self.endpoints = Endpoints()
        self._address: bytes | None = None

    def check(self, handle: KVHandle) -> None:
        """Raise FingerprintMismatch unless ``handle``'s layout equals ours but for TP (which
        head-sliced pulls bridge)."""
        ours, theirs = without_tp(self.fingerprint), without_tp(handle.fingerprint)
        if theirs != ours:
            raise FingerprintMismatch(
                f"KV layout of {handle.worker_id} differs ({fingerprint_diff(ours, theirs)})"
            )

    def own_address(self) -> bytes:
        """Our UCX worker address, where servers send the KV (configures UCX on first use)."""
        if self._address is None:
            ucx_config.configure(self.host, self.port)
            self._address = own_address()
        return self._address

    async def connect(self, address: str) -> None:
        """Set up the endpoint to a server ahead of its first pull (a worker joined)."""
        self.own_address()
        _, raw = parse_address(address)
        await self.endpoints.get(raw)

    def disconnect(self, address: str) -> None:
        """Drop the endpoint to a server that left (nothing of ours may be posted on it)."""
        _, raw = parse_address(address)
        ep = self.endpoints.eps.get(raw)
        if ep is not None:
            self.endpoints.drop(raw, ep)

    async def pull(
        self,
        bus_id: str,
        handle: KVHandle,
        dst_block_ids: list[int],
        timeout: float = 30.0,
        *,
        address: str | None = None,
        heads: Heads | None = None,
    ) -> TransferStats:
        """Copy the handle's first ``ceil(num_tokens / block_size)`` blocks into ``dst_block_ids``:
        global KV heads ``heads`` (default: all ours) from the KV server at ``address`` (default:
        the handle's), which must hold all of them - one piece of a ``tp_layout.pull_plan``."""
        self.own_address()  # UCX is configured before its first use, whoever pulls first
        self.check(handle)
        own = self.slicer.heads
        want = own if heads is None else (int(heads[0]), int(heads[1]))
        if not own[0] <= want[0] < want[1] <= own[1]:
            raise KVTransferError(f"KV heads {list(want)} are not all held here {list(own)}")
        whole = want == own
        if not whole and self.slicer.parts is None:
            raise KVTransferError("this KV cache cannot be head-sliced (no split given)")
        n = blocks_for_tokens(handle.num_tokens, self.block_size)
        if len(handle.block_ids) < n or len(dst_block_ids) < n:
            raise KVTransferError(
                f"{n} blocks needed for {handle.num_tokens} tokens; handle has "
                f"{len(handle.block_ids)}, destination {len(dst_block_ids)}"
            )
        num_blocks = self.kv_cache.shape[0]
        if not all(0 <= b < num_blocks for b in dst_block_ids[:n]):
            raise KVTransferError("destination block id out of range")
        control_tag, raw = parse_address(address or handle.ucx_address)
        runs = block_runs(handle.block_ids[:n], dst_block_ids[:n])
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            try:
                ep, reused = await self.endpoints.get(raw)
            except Exception as exc:  # e.g. UCXXUnreachableError: the prefill worker is gone
                raise KVTransferError(
                    f"cannot reach {handle.worker_id} for the KV pull: {exc!r}"
                ) from exc
            pull = _Pull(ep)
            try:
                stats = await asyncio.wait_for(
                    self._pull(pull, control_tag, bus_id, handle, runs, want),
                    deadline - time.monotonic(),
                )
                break
            except asyncio.TimeoutError:
                if pull.incoming:  # receives point into our blocks: only an abort cancels them
                    self.endpoints.drop(raw, ep)
                raise KVTransferError(
                    f"KV pull from {handle.worker_id} timed out after {timeout}s"
                ) from None
            except KVTransferError:  # refused: nothing of ours is left posted
                if pull.incoming:  # unless it said yes in a form we cannot take
                    self.endpoints.drop(raw, ep)
                raise
            except BaseException as exc:
                self.endpoints.drop(raw, ep)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                if reused and time.monotonic() < deadline:  # a kept endpoint went stale: retry
                    log.info("endpoint to %s was stale (%r); reconnecting", handle.worker_id, exc)
                    continue
                raise KVTransferError(f"KV pull from {handle.worker_id} failed: {exc!r}") from exc
        stats.seconds = time.perf_counter() - t0
        stats.num_blocks = n
        return stats

    async def _pull(
        self,
        pull: _Pull,
        control_tag: int,
        bus_id: str,
        handle: KVHandle,
        runs: list[tuple[int, int, int]],
        heads: Heads,
    ) -> TransferStats:
        ep, tag = pull.ep, pull_tag()
        whole = heads == self.slicer.heads
        body = msgpack.packb(
            {
                "bus_id": bus_id,
                "token": handle.token,
                "fingerprint": handle.fingerprint,
                "runs": [[s, n] for s, _, n in runs],
                "reply_to": self.own_address(),
                "tag": tag,
                "heads": list(heads),
                "whole": whole,
                **({"checksum": True} if self.checksum else {}),
            },
            use_bin_type=True,
        )
        if len(body) > MAX_CONTROL_BYTES - 4:
            raise KVTransferError(f"pull request of {len(body)} bytes is too large")
        message = np.frombuffer(len(body).to_bytes(4, "little") + body, dtype=np.uint8)
        # The reply lands in a buffer of its own, so its receive may outlive a failed pull.
        reply = np.zeros(REPLY_BYTES, dtype=np.uint8)
        got_reply = asyncio.ensure_future(ucx_progress.recv(ep, reply, tag + 1))
        got_reply.add_done_callback(retrieve)
        await asyncio.sleep(0)  # let it post its receive before we ask
        await asyncio.gather(ucx_progress.send(ep, message, control_tag), got_reply)
        error = unpack_reply(reply)
        if error is not None:
            raise KVTransferError(f"{handle.worker_id} refused the pull: {error}")
        pull.incoming = True
        sliced = reply_sliced(reply)
        if sliced and self.slicer.parts is None or not sliced and not whole:
            # whole blocks would overwrite heads we did not ask for; slices need our parts
            raise KVTransferError(f"{handle.worker_id} answered in a form this cache cannot take")
        units = self.hasher.units(heads)
        if self.checksum and reply_sums(reply) != units:
            raise KVChecksumError(
                f"{handle.worker_id} sends {reply_sums(reply)} checksums per block, not "
                f"{units}: the pull cannot be verified"
            )
        # Only now receive into our blocks: a refusal leaves nothing posted that points there.
        if sliced:
            landing = [self.slicer.landing(dst, count, heads) for _, dst, count in runs]
        else:
            landing = [(self.kv_cache[dst : dst + count], False) for _, dst, count in runs]
        # one batch, one future: a receive and a future per run cost a fragmented pull (a run
        # per block) as much Python time as moving its bytes (ucx_progress, issue 29)
        received = [ucx_progress.recv_many(ep, [buffer(t) for t, _ in landing], tag + 2)]
        if self.checksum:  # after the runs, on T+3 (checksum.py)
            sums = np.zeros((sum(count for *_, count in runs), units), dtype=np.uint64)
            received.append(asyncio.ensure_future(ucx_progress.recv(ep, sums, tag + 3)))
        for fut in received:
            fut.add_done_callback(retrieve)
        await asyncio.gather(*received)
        for (_, dst, count), (staging, staged) in zip(runs, landing, strict=True):
            if staged:
                self.slicer.unpack(staging, dst, count, heads)
        pull.incoming = False
        await settle([t for t, staged in landing if staged])  # the KV is in when we return
        stats = TransferStats(
            num_bytes=sum(t.numel() * t.element_size() for t, _ in landing),
            num_messages=len(landing),
        )
        if self.checksum:  # the blocks as they will be served, off the event loop
            t0 = time.perf_counter()
            dst_runs = [(dst, count) for _, dst, count in runs]
            await asyncio.to_thread(self.hasher.verify, dst_runs, heads, sums, handle.worker_id)
            stats.checksum_seconds = time.perf_counter() - t0
        return stats

    async def close(self) -> None:
        self.endpoints.clear()
