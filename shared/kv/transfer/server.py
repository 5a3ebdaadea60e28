"""The prefill side: serves leased blocks to pullers that show the lease's token.

What a pull may have is ``admission.py``'s to decide; this module receives the requests, holds
a streamed piece until its layers are written, and moves the bytes (the sends, followed to their
end, the lease unpinned)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdserve.shared.kv import ucx_config, ucx_progress
from pdserve.shared.kv.transfer.admission import Admission
from pdserve.shared.kv.transfer.answer import Answer, Refusal
from pdserve.shared.kv.transfer.checksum import KVHasher, hash_lease, lease_sums
from pdserve.shared.kv.transfer.heads import Heads, HeadSlicer, Split, settle
from pdserve.shared.kv.transfer.lease import Lease, LeaseTable
from pdserve.shared.kv.transfer.request import PullRequest, decode_request
from pdserve.shared.kv.transfer.stream import LayerViews, when_ready
from pdserve.shared.kv.transfer.watch import Transfers, done_or_after, watch_sends
from pdserve.shared.kv.transfer.wire import (
    EMPTY,
    MAX_CONTROL_BYTES,
    MAX_PENDING_REQUESTS,
    REPLY_TIMEOUT,
    BlockBytes,
    Endpoints,
    buffer,
    control_tag,
    format_address,
    host_view,
    own_address,
    pack_reply,
)

log = logging.getLogger(__name__)
# How long the server waits for a transfer it just started before it posts the receive for the
# next request (one that comes meanwhile waits in UCX): a 1 MiB pull takes ~0.1 ms here.
REPOST_AFTER = 300e-6


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
        if checksum:  # a streamed lease is still being written: hashed when a pull asks
            leases.on_add = lambda lease: lease.stream or hash_lease(self.hasher, lease)
        self.layer_views = LayerViews(self.slicer.parts) if self.slicer.parts else None
        self.fingerprint = dict(fingerprint)
        self.blocks = BlockBytes(kv_cache)
        self._replies: dict[tuple[bool, int], Any] = {}  # see _yes
        self.leases = leases
        self.admission = Admission(self.slicer, self.blocks, self.layer_views, leases, fingerprint)
        self.host = host
        self.port = port
        self.control_tag = control_tag()
        self.address = ""  # set by start(): what decode workers are told
        self.endpoints = Endpoints()
        self._accept_task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self.transfers = Transfers(leases.clock)  # whose sends are in flight
        self._probe: tuple[object, object] | None = None  # see _queued
        self.pulls_served = 0  # answered with the KV (its sends posted)
        self.pulls_aborted = 0  # of those, the ones whose sends did not all complete
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
        view = memoryview(buf)  # read in place: the request is decoded, never copied out
        while True:
            try:
                await ucx_progress.worker_recv(buf, self.control_tag)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # e.g. a message longer than the buffer: not ours
                self._drop(f"malformed request ({exc!r})")
                buf[:] = 0
                continue
            size = int.from_bytes(view[:4], "little")
            if not 0 < size <= MAX_CONTROL_BYTES - 4:
                self._drop(f"request claims {size} bytes")
                buf[:] = 0
                continue
            if len(self._requests) + len(self.transfers) >= MAX_PENDING_REQUESTS:
                self._drop(f"{len(self._requests) + len(self.transfers)} requests in progress")
                buf[: 4 + size] = 0
                continue
            try:
                sending = self._on_request(view[4 : 4 + size])
            except Exception:  # a bug must not stop the server from taking requests
                log.exception("KV pull request failed")
                buf[: 4 + size] = 0
                continue
            try:
                if sending is not None and not sending.done() and not self._queued():
                    # The next request may wait in UCX (it holds a message that comes before
                    # its receive): posting the receive for it now, ~8 us of Python, would
                    # stall the copy this process does for the transfer just started
                    # (watch.py). One that is already waiting is taken at once.
                    await done_or_after(sending, REPOST_AFTER)
            finally:  # the request is decoded (nothing reads the buffer): zeroed off the
                buf[: 4 + size] = 0  # path of its transfer's start, before the next receive

    def _queued(self) -> bool:
        """Whether a request waits in UCX, unreceived (``ucp_tag_probe_nb``: no progress)."""
        if self._probe is None:  # an import and a Tag per look cost more than the look
            from ucxx.types import Tag

            self._probe = (ucx_progress.driver().worker, Tag(self.control_tag))
        worker, tag = self._probe
        return bool(worker.tag_probe(tag).matched)

    def _drop(self, why: str) -> None:
        self.requests_dropped += 1
        log.warning("dropped a KV pull request: %s", why)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    def _on_request(self, body: memoryview) -> asyncio.Future | None:
        """Check a request and answer it - in this loop turn when we hold an endpoint to the
        puller and the data needs no device copy first: the puller's receives are posted
        (wire.KV_WIRE_VERSION), so each turn of the loop here delays the KV. Returns the sends
        of a transfer started here."""
        try:
            req = decode_request(body)
        except Exception as exc:
            self._drop(repr(exc))
            return
        if not self.admission.authentic(req):
            self._drop(f"no valid lease token for {req.bus_id[:64]!r}")
            return
        try:
            answer: Answer | str = self.admission.admit(req)
        except Refusal as exc:
            answer = str(exc)
        if not isinstance(answer, str) and not answer.ready():
            self._hold(req, answer)  # a streamed piece whose layers prefill has not written
            return None
        return self._answer_now(req, answer)

    def _answer_now(self, req: PullRequest, answer: Answer | str) -> asyncio.Future | None:
        ep = self.endpoints.cached(req.reply_to)
        if ep is None or not isinstance(answer, str) and answer.waits_for_device():
            self._spawn(self._answer_later(req, answer))
            return None
        return self._answer(ep, req, answer)

    def _hold(self, req: PullRequest, answer: Answer) -> None:
        """Answer a streamed piece once its layers are written (the final piece: once the first
        token is sampled), or refuse it when the prompt will never be complete or the lease is
        let go. The lease stays pinned meanwhile: its blocks cannot be freed under the send."""

        def refuse(why: str) -> None:
            self.leases.unpin(answer.lease)
            self._answer_now(req, why)

        when_ready(answer.lease, answer.ready, lambda: self._answer_now(req, answer), refuse)

    async def _answer_later(self, req: PullRequest, answer: Answer | str) -> None:
        try:
            ep = await self.endpoints.get(req.reply_to)
            if not isinstance(answer, str):
                await settle(answer.staged)  # UCX must not read half a copy
                if answer.event is not None:  # the layers' kernels must have written them
                    await asyncio.to_thread(answer.event.synchronize)
        except BaseException as exc:  # the puller's address does not answer, or we stop
            log.info("KV pull of %s not answered: %r", req.bus_id, exc)
            if not isinstance(answer, str):
                self.leases.unpin(answer.lease)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._answer(ep, req, answer)

    def _answer(self, ep, req: PullRequest, answer: Answer | str) -> asyncio.Future | None:
        """Post the sends of a yes (the runs, the reply, the checksums if asked; returned) or
        a refusal, and follow them to their end."""
        tag = req.tag
        if isinstance(answer, str):
            self.pulls_refused += 1
            sends = [ucx_progress.send(ep, pack_reply(answer), tag + 1)]
            if req.runs is not None:  # its receives are posted: complete them empty
                sends += self._empties(ep, req, tag)
            self._spawn(self._refused(ep, req, sends))
            return None
        try:
            return self._send_yes(ep, req, answer)
        except BaseException:
            self.leases.unpin(answer.lease)  # nothing follows the sends: let the lease go
            raise

    def _send_yes(self, ep, req: PullRequest, answer: Answer) -> asyncio.Future:
        tag = req.tag
        views = answer.views
        if self.fault is not None:
            views = [buffer(v) for v in self.fault([torch.as_tensor(host_view(v)) for v in views])]
        lease, heads = answer.lease, answer.heads
        sums = self.hasher.units(heads) if req.checksum else 0
        # every run in flight at once, then the reply, in one post: UCX pipelines them, one
        # tag keeps the runs' order, and the puller wakes once, for the last byte
        yes = self._yes(answer.sliced, sums)
        if answer.lease.stream is not None and answer.final:  # the first token with the KV
            yes = pack_reply(None, answer.sliced, sums, answer.lease.stream.first_token)
        sends = [ucx_progress.send_many(ep, [*views, yes], [tag + 2] * len(views) + [tag + 1])]
        if sums:
            sends.append(self._send_sums(ep, lease, req.runs, heads, tag + 3))
        self.pulls_served += 1
        # followed by callbacks, not a task: the loop turns right after posting belong to
        # UCX's progress, which copies the KV (watch.py)
        all_sent = sends[0] if len(sends) == 1 else asyncio.gather(*sends)
        self.transfers.add(all_sent, lease, lambda exc: self._sent(ep, req, lease, exc))
        return all_sent

    def _empties(self, ep, req: PullRequest, tag: int) -> list:
        count = len(req.runs)
        if req.layers is not None:  # a streamed piece: a message per block and part
            if self.layer_views is None:
                return []  # the puller's timeout aborts its receives
            count = self.layer_views.count(req.runs)
        sends = [ucx_progress.send_many(ep, [EMPTY] * count, tag + 2)]
        if req.checksum:
            sends.append(ucx_progress.send(ep, EMPTY, tag + 3))
        return sends

    def _yes(self, sliced: bool, sums: int) -> Any:
        """A yes reply, built once per form as the Array a post takes (sends only read it)."""
        reply = self._replies.get((sliced, sums))
        if reply is None:
            reply = self._replies[(sliced, sums)] = ucx_progress.array(
                pack_reply(None, sliced, sums)
            )
        return reply

    async def _refused(self, ep, req: PullRequest, sends: list) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*sends), REPLY_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("refusal of %s not delivered: %r", req.bus_id, exc)
            self.endpoints.drop(req.reply_to, ep)

    def _sent(self, ep, req: PullRequest, lease: Lease, exc: BaseException | None) -> None:
        """A transfer's end: the lease unpinned; a failed one also ends its endpoint."""
        self.leases.unpin(lease)
        if exc is not None:  # the puller went away or gave up mid-transfer
            log.info("KV pull of %s aborted: %r", req.bus_id, exc)
            self.pulls_aborted += 1
            self.endpoints.drop(req.reply_to, ep)  # cancels whatever is still being sent

    async def _send_all(self, sends: asyncio.Future, lease: Lease) -> None:
        """Wait for a transfer's sends, or fail once the puller is taken to have stopped
        receiving (``watch.Transfers``)."""
        await watch_sends(sends, lease, self.leases.clock)

    async def _send_sums(self, ep, lease: Lease, runs: list, heads: Heads, tag: int) -> None:
        """The checksums of the pulled blocks' heads, after the runs (``checksum.py``)."""
        sums = await lease_sums(self.hasher, lease, runs, heads)
        await ucx_progress.send(ep, sums.view(np.uint8).reshape(-1), tag)
