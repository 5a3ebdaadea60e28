"""The prefill side: serves leased blocks to pullers that show the lease's token."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable

import numpy as np
import torch

from pdserve.shared.kv import ucx_config, ucx_progress
from pdserve.shared.kv.tp_layout import without_tp
from pdserve.shared.kv.transfer.checksum import KVHasher, hash_lease, lease_sums
from pdserve.shared.kv.transfer.heads import Heads, HeadSlicer, Split, settle
from pdserve.shared.kv.transfer.lease import Lease, LeaseTable
from pdserve.shared.kv.transfer.wire import (
    MAX_CONTROL_BYTES,
    MAX_PENDING_REQUESTS,
    ORPHAN_GRACE,
    REPLY_TIMEOUT,
    Endpoints,
    KVTransferError,
    buffer,
    control_tag,
    fingerprint_diff,
    format_address,
    own_address,
    pack_reply,
    retrieve,
    unpack_request,
)

log = logging.getLogger("pdserve.kv")


class KVServer:
    """Serves leased blocks of ``kv_cache`` to pullers that show the lease's token.

    ``heads``: the global KV heads ``(lo, hi)`` this rank's cache holds (None: all of the
    fingerprint's ``num_kv_heads``, TP 1). ``split``: the storage's parts, each ``[n, layers, 2,
    block_size, heads, X]`` (None: the storage is its one part) - see ``heads.HeadSlicer``.
    ``checksum``: hash every lease's blocks when it is added (``--kv-checksum``, ``checksum.py``);
    a puller that asks gets hashes either way."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        leases: LeaseTable,
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
        if checksum:
            leases.on_add = lambda lease: hash_lease(self.hasher, lease)
        self.fingerprint = dict(fingerprint)
        self.leases = leases
        self.host = host
        self.port = port
        self.control_tag = control_tag()
        self.address = ""  # set by start(): what decode workers are told
        self.endpoints = Endpoints()
        self._accept_task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self.pulls_served = 0
        self.pulls_refused = 0  # answered with a reason
        self.requests_dropped = 0  # malformed, unauthenticated or over the limit: not answered
        # tests only: what a pull's run messages become on the wire (to damage them in flight)
        self.fault: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None

    async def start(self) -> None:
        ucx_config.configure(self.host, self.port)
        self.address = format_address(self.control_tag, own_address())
        ucx_progress.driver()  # requests arrive on this loop before any endpoint exists
        self._accept_task = asyncio.create_task(self._accept())
        log.info("KV transfer serving on UCX (%s); pulls need a lease token", self.host)

    async def stop(self) -> None:
        tasks = [t for t in (self._accept_task, *self._requests) if t is not None]
        for task in tasks:
            task.cancel()
        self.endpoints.clear()  # aborts sends in flight
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accept_task = None

    async def _accept(self) -> None:
        # One buffer for every request: a message may be shorter than the buffer, so each one
        # says its length, and the bytes it used are zeroed afterwards - a message that claims
        # more than it sent must never read what an earlier request (its token) left behind.
        buf = np.zeros(MAX_CONTROL_BYTES, dtype=np.uint8)
        while True:
            try:
                await ucx_progress.worker_recv(buf, self.control_tag)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # e.g. a message longer than the buffer: not ours
                self._drop(f"malformed request ({exc!r})")
                buf[:] = 0
                continue
            size = int.from_bytes(buf[:4].tobytes(), "little")
            if not 0 < size <= MAX_CONTROL_BYTES - 4:
                self._drop(f"request claims {size} bytes")
                buf[:] = 0
                continue
            body = buf[4 : 4 + size].tobytes()
            buf[: 4 + size] = 0
            if len(self._requests) >= MAX_PENDING_REQUESTS:
                self._drop(f"{len(self._requests)} requests in progress")
                continue
            task = asyncio.create_task(self._serve(body))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    def _drop(self, why: str) -> None:
        self.requests_dropped += 1
        log.warning("dropped a KV pull request: %s", why)

    async def _serve(self, body: bytes) -> None:
        try:
            req = unpack_request(body)
        except Exception as exc:
            self._drop(repr(exc))
            return
        tag = req.get("tag")
        if type(tag) is not int or not 0 <= tag < 1 << 63:  # T+3 must fit in 64 bits
            self._drop("bad tag")
            return
        rid, reply_to = req.get("bus_id"), req.get("reply_to")
        if not self._authentic(req):
            self._drop(f"no valid lease token for {str(rid)[:64]!r}")
            return
        try:
            lease, heads, sliced = self._admit(req)
            error = None
        except Refusal as exc:
            lease, heads, sliced, error = None, self.slicer.heads, False, str(exc)
        ep = None
        try:
            ep, _ = await self.endpoints.get(reply_to)
            if lease is None:
                self.pulls_refused += 1
                await asyncio.wait_for(
                    ucx_progress.send(ep, pack_reply(error), tag + 1), REPLY_TIMEOUT
                )
                return
            self.leases.pin(lease)
            try:
                views = await self._messages(req["runs"], heads, sliced)
                if self.fault is not None:
                    views = self.fault(views)
                sums = self.hasher.units(heads) if req.get("checksum") is True else 0
                sends = [ucx_progress.send(ep, pack_reply(None, sliced, sums), tag + 1)]
                # every run in flight at once: UCX pipelines them, one tag keeps their order
                sends.append(ucx_progress.send_many(ep, [buffer(v) for v in views], tag + 2))
                if sums:
                    sends.append(self._send_sums(ep, lease, req["runs"], heads, tag + 3))
                await self._send_all(asyncio.gather(*sends), lease)
            finally:
                self.leases.unpin(lease)
            self.pulls_served += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the puller went away or gave up mid-transfer
            log.info("KV pull of %s aborted: %r", rid, exc)
            if ep is not None:
                self.endpoints.drop(reply_to, ep)  # cancels whatever is still being sent

    async def _messages(
        self, runs: list[list[int]], heads: Heads, sliced: bool
    ) -> list[torch.Tensor]:
        """One message per run: the blocks themselves, or their head slice (packed unless it is
        one contiguous piece of the cache)."""
        if not sliced:
            return [self.kv_cache[start : start + count] for start, count in runs]
        packed = [self.slicer.pack(start, count, heads) for start, count in runs]
        await settle([t for t, copied in packed if copied])  # UCX must not read half a copy
        return [t for t, _ in packed]

    async def _send_sums(self, ep, lease: Lease, runs: list, heads: Heads, tag: int) -> None:
        """The checksums of the pulled blocks' heads, after the runs (``checksum.py``)."""
        sums = await lease_sums(self.hasher, lease, runs, heads)
        await ucx_progress.send(ep, sums.view(np.uint8).reshape(-1), tag)

    async def _send_all(self, sends: asyncio.Future, lease: Lease) -> None:
        """Wait for a transfer's sends. A puller that gave up has cancelled its receives, so our
        sends would wait forever and pin the lease: once the lease is let go (or long expired),
        a short grace later the transfer counts as abandoned."""
        dropped = asyncio.get_running_loop().create_future()

        def on_drop() -> None:
            if not dropped.done():
                dropped.set_result(None)

        lease.on_drop.append(on_drop)
        if lease.dropped:
            on_drop()
        try:
            expiry = max(0.0, lease.expires - self.leases.clock()) + ORPHAN_GRACE
            done, _ = await asyncio.wait(
                {sends, dropped}, timeout=expiry, return_when=asyncio.FIRST_COMPLETED
            )
            if sends not in done and dropped in done:
                await asyncio.wait({sends}, timeout=ORPHAN_GRACE)
            if not sends.done():
                sends.add_done_callback(retrieve)  # cancelled with the endpoint, unread
                raise KVTransferError("the puller stopped receiving")
            sends.result()
        finally:
            lease.on_drop.remove(on_drop)

    def _authentic(self, req: dict) -> bool:
        """Whether the request shows the token of a live or recently dropped lease."""
        rid, token, reply_to = (req.get(k) for k in ("bus_id", "token", "reply_to"))
        if type(rid) is not str or type(token) is not str or type(reply_to) is not bytes:
            return False
        expected = self.leases.token_of(rid)
        return expected is not None and hmac.compare_digest(expected, token)

    def _admit(self, req: dict) -> tuple[Lease, Heads, bool]:
        """Check an authentic pull request completely before any KV byte moves: the lease, the
        heads to send and whether as head slices; or raise Refusal with the reason."""
        rid, fp, runs = (req.get(k) for k in ("bus_id", "fingerprint", "runs"))
        if type(fp) is not dict:
            raise Refusal("malformed pull request")
        ours, theirs = without_tp(self.fingerprint), without_tp(fp)
        if theirs != ours:  # TP alone may differ: head-sliced pulls bridge it
            raise Refusal(f"KV layout mismatch ({fingerprint_diff(ours, theirs)})")
        try:
            heads, whole = self.slicer.requested(req.get("heads"), req.get("whole"))
        except ValueError as exc:
            raise Refusal(str(exc)) from None
        lease = self.leases.get(rid)
        if lease is None:
            raise Refusal(f"no lease for {rid} (expired or released)")
        if type(runs) is not list or not runs:
            raise Refusal("malformed runs")
        leased = set(lease.block_ids)
        for run in runs:
            if (
                type(run) is not list
                or len(run) != 2
                or not all(type(x) is int for x in run)
                or run[1] < 1
                or not set(range(run[0], run[0] + run[1])) <= leased
            ):
                raise Refusal("requested blocks are not part of the lease")
        # whole blocks only where both caches hold exactly these heads: the same block layout
        return lease, heads, not (whole and heads == self.slicer.heads)


class Refusal(Exception):
    """Why an authentic pull request is answered no."""
