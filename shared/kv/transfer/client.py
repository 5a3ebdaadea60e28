"""The decode side: pulls a KV handle's blocks straight into blocks of its own cache."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv import ucx_config, ucx_exchange
from pdserve.shared.kv.tp_layout import TP_KEY, without_tp
from pdserve.shared.kv.transfer.checksum import KVChecksumError, KVHasher
from pdserve.shared.kv.transfer.heads import Heads, HeadSlicer, Split, settle
from pdserve.shared.kv.transfer.request import (
    CHECKSUM,
    FINAL,
    PIECE,
    SLICED,
    WHOLE,
    RequestWriter,
)
from pdserve.shared.kv.transfer.stream import FINISHED, KVStreamFinished, Layers, LayerViews
from pdserve.shared.kv.transfer.wire import (
    KV_WIRE_VERSION,
    REPLY_BYTES,
    BlockBytes,
    Endpoints,
    FingerprintMismatch,
    KVTransferError,
    TransferStats,
    block_runs,
    blocks_for_tokens,
    buffer,
    fingerprint_diff,
    nbytes,
    own_address,
    pack_reply,
    parse_address,
    pull_tag,
    read_reply,
    reply_leaves_posted,
)

log = logging.getLogger(__name__)
# How long a cancelled pull (its request gone) waits for the server to complete its posted
# receives - with the KV under way, in milliseconds, or empty for a held piece, refused once
# its prefill ends or its lease goes - before it aborts the endpoint, the only way to take a
# posted receive back. An abort cancels every other pull on the endpoint, and the peer, which
# notices it late, failed the endpoints made in its place for a while: a gateway's cancel of a
# request that ended at its first token cost the next request's pull its KV that way.
CANCEL_GRACE = 2.0


@dataclass
class _Pull:
    ep: Any
    # receives into our blocks are posted on this endpoint: until the server has completed
    # every one (with KV, or with empty messages when it refuses), only an abort cancels them
    incoming: bool = False
    exchange: ucx_exchange.Exchange | None = None  # the request and those receives


class KVClient:
    """Pulls KV handles into ``kv_cache``; keeps one endpoint per prefill worker.

    ``heads``: the global KV heads ``(lo, hi)`` this rank's cache holds (None: all of the
    fingerprint's ``num_kv_heads``, TP 1). ``split``: the storage's parts, each ``[n, layers, 2,
    block_size, heads, X]`` (None: the storage is its one part) - see ``heads.HeadSlicer``.
    ``checksum``: verify every pull against the server's hashes (``--kv-checksum``,
    ``checksum.py``); a mismatch raises KVChecksumError. The decode side's ``KVPiecePuller``
    (``shared/kv/contract.py``)."""

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
        self.blocks = BlockBytes(kv_cache)
        self.layer_views = LayerViews(self.slicer.parts) if self.slicer.parts else None
        self.endpoints = Endpoints()
        self._address: bytes | None = None
        self._addresses: dict[str, tuple[int, bytes]] = {}  # parsed once per server
        self._checked: dict | None = None  # the last handle fingerprint that matched ours
        self.requests = RequestWriter()
        self._yeses: dict[tuple[bool, int], bytes] = {}  # see _yes

    def _parse(self, address: str) -> tuple[int, bytes]:
        parsed = self._addresses.get(address)
        if parsed is None:
            parsed = parse_address(address)
            if len(self._addresses) >= len(self.endpoints.eps) + 64:  # servers come and go
                self._addresses.clear()
            self._addresses[address] = parsed
        return parsed

    def check(self, handle: KVHandle) -> None:
        """Raise FingerprintMismatch unless ``handle``'s layout equals ours but for TP (which
        head-sliced pulls bridge)."""
        if handle.fingerprint == self._checked:  # a worker's handles all carry the same one
            return
        ours, theirs = without_tp(self.fingerprint), without_tp(handle.fingerprint)
        if theirs != ours:
            raise FingerprintMismatch(
                f"KV layout of {handle.worker_id} differs ({fingerprint_diff(ours, theirs)})"
            )
        self._checked = dict(handle.fingerprint)

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
        layers: Layers | None = None,
        final: bool = False,
        span: tuple[int, int] | None = None,
    ) -> TransferStats:
        """Copy the handle's first ``ceil(num_tokens / block_size)`` blocks into ``dst_block_ids``:
        global KV heads ``heads`` (default: all ours) from the KV server at ``address`` (default:
        the handle's), which must hold all of them - one piece of a ``tp_layout.pull_plan``.
        ``layers``: only that layer group of a streamed lease, whole blocks (``stream.py``);
        the ``final`` piece also brings the first token (``TransferStats.first_token``);
        ``span``: only the blocks at those positions ``[a, b)`` of the needed ones."""
        self.own_address()  # UCX is configured before its first use, whoever pulls first
        self.check(handle)
        own = self.slicer.heads
        want = own if heads is None else (int(heads[0]), int(heads[1]))
        if not own[0] <= want[0] < want[1] <= own[1]:
            raise KVTransferError(f"KV heads {list(want)} are not all held here {list(own)}")
        whole = want == own
        if not whole and self.slicer.parts is None:
            raise KVTransferError("this KV cache cannot be head-sliced (no split given)")
        if layers is not None and (self.layer_views is None or self._sliced(handle, whole)):
            raise KVTransferError("layer pieces move whole blocks of a cache with known parts")
        n = blocks_for_tokens(handle.num_tokens, self.block_size)
        if len(handle.block_ids) < n or len(dst_block_ids) < n:
            raise KVTransferError(
                f"{n} blocks needed for {handle.num_tokens} tokens; handle has "
                f"{len(handle.block_ids)}, destination {len(dst_block_ids)}"
            )
        dst = dst_block_ids[:n]
        if dst and (min(dst) < 0 or max(dst) >= self.kv_cache.shape[0]):
            raise KVTransferError("destination block id out of range")
        control_tag, raw = self._parse(address or handle.ucx_address)
        a, b = span or (0, n)
        runs = block_runs(handle.block_ids[a:b], dst[a:b])
        sliced = self._sliced(handle, whole)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        attempts = 0
        while True:
            try:
                ep = self.endpoints.cached(raw)
                if ep is None:
                    ep = await self.endpoints.get(raw)
            except Exception as exc:  # e.g. UCXXUnreachableError: the prefill worker is gone
                raise KVTransferError(
                    f"cannot reach {handle.worker_id} for the KV pull: {exc!r}"
                ) from exc
            pull = _Pull(ep)
            try:
                stats = await self._pull(
                    pull,
                    control_tag,
                    bus_id,
                    handle,
                    runs,
                    want,
                    sliced,
                    deadline,
                    (layers, final),
                )
                break
            except TimeoutError:
                if pull.incoming:  # receives point into our blocks: only an abort cancels them
                    self.endpoints.drop(raw, ep)
                raise KVTransferError(
                    f"KV pull from {handle.worker_id} timed out after {timeout}s"
                ) from None
            except KVTransferError:  # refused: the server completed our receives, if any
                if pull.incoming:  # unless it could not (or answered in a form we cannot take)
                    self.endpoints.drop(raw, ep)
                raise
            except asyncio.CancelledError:  # abort only if the server does not end it soon
                grace = min(deadline, time.monotonic() + CANCEL_GRACE) - time.monotonic()
                if pull.incoming and not (pull.exchange and await pull.exchange.settled(grace)):
                    self.endpoints.drop(raw, ep)
                raise
            except BaseException as exc:
                self.endpoints.drop(raw, ep)
                attempts += 1
                if attempts == 1 and time.monotonic() < deadline:
                    # once more, on a fresh endpoint: a kept one went stale, or another pull's
                    # cancel aborted it under us (here, or at the peer); a dead peer fails again
                    log.info("endpoint to %s failed (%r); reconnecting", handle.worker_id, exc)
                    continue
                raise KVTransferError(f"KV pull from {handle.worker_id} failed: {exc!r}") from exc
        stats.seconds = time.perf_counter() - t0
        stats.num_blocks = b - a
        return stats

    def _sliced(self, handle: KVHandle, whole: bool) -> bool:
        """The form we receive in, decided before the server answers (our receives are posted
        by then): whole blocks where the server's cache holds exactly our heads, which
        equal TP sizes mean (``tp_layout.pull_plan`` pulls a range from the rank holding it);
        else head slices. A server whose heads differ refuses whole blocks."""
        if not whole:
            return True
        if self.slicer.parts is None:
            return False  # an opaque cache takes whole blocks only
        return handle.fingerprint.get(TP_KEY, 1) != self.fingerprint.get(TP_KEY, 1)

    def _request(self, bus_id: str, handle: KVHandle, runs, tag: int, heads, sliced, piece) -> Any:
        """The request message (``request.py``)."""
        flags = (WHOLE if heads == self.slicer.heads else 0) | (SLICED if sliced else 0)
        flags |= CHECKSUM if self.checksum else 0
        layers, final = piece
        if layers is not None:  # a streamed lease's layer group
            flags |= PIECE | (FINAL if final else 0)
        layers = layers or (0, 0)
        return self.requests.write(
            self.own_address(),
            bus_id,
            handle,
            tag=tag,
            flags=flags,
            heads=heads,
            layers=layers,
            runs=runs,
        )

    async def _pull(
        self,
        pull: _Pull,
        control_tag: int,
        bus_id: str,
        handle: KVHandle,
        runs: list[tuple[int, int, int]],
        heads: Heads,
        sliced: bool,
        deadline: float,
        piece: tuple[Layers | None, bool] = (None, False),
    ) -> TransferStats:
        """One try of a pull on ``pull.ep``; its network wait ends at ``deadline``
        (``time.monotonic``) with TimeoutError. ``piece``: (layers, final) of a streamed lease's
        layer group, or (None, False) for every layer."""
        ep, tag = pull.ep, pull_tag()
        message = self._request(bus_id, handle, runs, tag, heads, sliced, piece)
        # Ask first, then post every receive while the request travels and the server checks
        # it (UCX holds a message that comes before its receive - eager bytes buffered, a
        # rendezvous by its announcement - and matches it once the receive is posted). The
        # server sends the KV the moment its checks pass, the reply beside it: no round trip
        # between its yes and the data, one wake-up here. A refusal completes our receives
        # with empty messages (wire.KV_WIRE_VERSION).
        pull.incoming = True
        asked = ucx_exchange.ask(ep, message, control_tag)
        if piece[0] is not None:  # a message per block (and part): part[block, lo:hi]
            landing = []
            buffers = self.layer_views.of([(dst, count) for _, dst, count in runs], piece[0])
        elif sliced:
            landing = [self.slicer.landing(dst, count, heads) for _, dst, count in runs]
            buffers = [buffer(t) for t, _ in landing]
        else:
            landing = []
            buffers = [self.blocks.message(dst, count) for _, dst, count in runs]
        # The reply lands in a buffer of its own, so its receive may outlive a failed pull.
        reply = np.zeros(REPLY_BYTES, dtype=np.uint8)
        posted = [reply, *buffers]
        tags = [tag + 1] + [tag + 2] * len(buffers)
        sums, units = None, 0
        if self.checksum:  # after the runs, on T+3 (checksum.py)
            units = self.hasher.units(heads)
            sums = np.zeros((sum(count for *_, count in runs), units), dtype=np.uint64)
            posted.append(sums)
            tags.append(tag + 3)
        # one future for the request and every receive: the puller wakes once, for the last
        # byte - or at once for a refusal from a server that leaves our receives posted
        answered, pull.exchange = ucx_exchange.exchange(
            ep, asked, message, posted, tags, lambda: reply_leaves_posted(reply)
        )
        # Everything a yes needs is ready before the wait: after the last byte this process
        # is the last one working on the pull, on caches the copy has just flushed.
        stats = TransferStats(num_bytes=sum(map(nbytes, buffers)), num_messages=len(buffers))
        yes = self._yes(sliced, units)
        head = memoryview(reply)[: len(yes)]
        # the deadline is a loop timer (``time.monotonic``): ``asyncio.timeout`` cost ~8 us
        timer = answered.get_loop().call_at(deadline, _expire, answered)
        try:
            await answered
        finally:
            timer.cancel()
        if head == yes and not landing and not self.checksum and not piece[1]:
            pull.incoming = False  # every receive has completed
            return stats
        return await self._answered(
            pull, bus_id, handle, reply, (runs, heads, sliced, landing), stats, sums
        )

    def _yes(self, sliced: bool, sums: int) -> bytes:
        """The head of a yes in this form (``wire.pack_reply``): what most replies are."""
        yes = self._yeses.get((sliced, sums))
        if yes is None:
            yes = self._yeses[(sliced, sums)] = pack_reply(None, sliced, sums)[:6].tobytes()
        return yes

    async def _answered(
        self,
        pull: _Pull,
        bus_id: str,
        handle: KVHandle,
        reply: np.ndarray,
        asked: tuple,
        stats: TransferStats,
        sums: np.ndarray | None,
    ) -> TransferStats:
        """A pull whose receives are all done (or left posted by an older server's refusal):
        a refusal raised; a yes checked, unpacked and verified. ``asked``: the pull's runs,
        heads, form and staging (``_pull``)."""
        runs, heads, sliced, landing = asked
        error, version, their_sliced, their_sums, first_token = read_reply(reply)
        if error is not None:
            pull.incoming = version < KV_WIRE_VERSION  # an older server left them posted
            if error == FINISHED:
                raise KVStreamFinished(f"the request {bus_id} {error}")
            raise KVTransferError(f"{handle.worker_id} refused the pull: {error}")
        pull.incoming = False  # every receive has completed
        if version != KV_WIRE_VERSION or their_sliced != sliced:
            # whole blocks would overwrite heads we did not ask for; slices need our parts
            raise KVTransferError(f"{handle.worker_id} answered in a form this cache cannot take")
        units = self.hasher.units(heads)
        if self.checksum and their_sums != units:
            raise KVChecksumError(
                f"{handle.worker_id} sends {their_sums} checksums per block, not "
                f"{units}: the pull cannot be verified"
            )
        if landing:  # head slices: unpack what came through staging
            for (_, dst, count), (staging, staged) in zip(runs, landing, strict=True):
                if staged:
                    self.slicer.unpack(staging, dst, count, heads)
            await settle([t for t, staged in landing if staged])  # the KV is in when we return
        stats.first_token = first_token
        if self.checksum:  # the blocks as they will be served, off the event loop
            t0 = time.perf_counter()
            dst_runs = [(dst, count) for _, dst, count in runs]
            await asyncio.to_thread(self.hasher.verify, dst_runs, heads, sums, handle.worker_id)
            stats.checksum_seconds = time.perf_counter() - t0
        return stats

    async def close(self) -> None:
        self.endpoints.clear()


def _expire(answered: asyncio.Future) -> None:
    """A pull's deadline: its wait ends with TimeoutError (what is posted stays tracked)."""
    if not answered.done():
        answered.set_exception(TimeoutError())
