"""KV-cache transfer over UCX (ucxx): the decode worker pulls a prefill worker's leased blocks
straight into blocks it allocated in its own cache.

The engine's cache is one block-major tensor ``[num_blocks, layers, 2, block_size, kv_heads,
head_dim]``, so a run of consecutive block ids is one contiguous byte range on either side. A pull
pairs source and destination ids, cuts the pairs into runs that are consecutive on *both* sides,
and moves each run as a single UCX message - no per-layer or per-token chatter.

Both ends connect by UCX *worker address* (``KVServer.address``, published on the bus), never
through a sockaddr listener: ucxx's listener can only bind the wildcard address, while the worker
address path listens only where ``shared.ucx_config`` lets UCX's transports listen
(``--ucx-host``/``--ucx-port``). Tags are 64-bit; every pull draws a fresh random tag ``T``, so
pulls on one endpoint run concurrently and never see each other's messages::

    decode -> prefill   on the server's control tag: u32 length + msgpack {request_id, token,
                        fingerprint, runs: [[src, n]..], reply_to: the decode worker's UCX
                        address, tag: T}
    prefill -> decode   on T+1: one fixed-size reply (ok, or the reason for a refusal)
    prefill -> decode   on T+2: one message per run, straight from / into the cache tensors

The puller posts the receive for the reply before it sends the request, and its receives into
its blocks once the reply says yes, all on its endpoint to the server. If the data does not come
in time the puller aborts that endpoint, which cancels every receive still pointing into its
blocks (so no late byte can reach blocks given to another request) and, UCX pairing the two
peers' endpoints, also fails the server's sends at once; a refusal leaves nothing posted.

The server checks the lease's secret token before anything else - until then it does not even
connect back to the address in the request - then the layout fingerprint and that every requested
block belongs to the lease. Leased blocks are pinned while they are being sent, so a lease that
expires mid-transfer is freed only after the last byte left.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from shared import ucx_config, ucx_progress
from shared.protocol import KVHandle

log = logging.getLogger("pdserve.kv")

MAX_CONTROL_BYTES = 1 << 20  # a pull request lists runs, never data
MAX_ADDRESS_BYTES = 8192  # a UCX worker address: a few hundred bytes, more with many RDMA ports
REPLY_BYTES = 512
MAX_PENDING_REQUESTS = 256  # requests a server works on at once
MAX_PEERS = 1024  # peers whose endpoints are kept
ORPHAN_GRACE = 2.0  # seconds a transfer may run on after its puller let the lease go
REPLY_TIMEOUT = 5.0  # seconds a refusal may take to send
ADDRESS_PREFIX = "ucx1"


class KVTransferError(RuntimeError):
    """A pull that did not deliver the KV (the request must fail or be recomputed)."""


class FingerprintMismatch(KVTransferError):
    """The two engines' KV layouts differ: copying bytes would corrupt the cache."""


@dataclass
class TransferStats:
    num_bytes: int = 0
    num_blocks: int = 0
    num_messages: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` runs, consecutive in both lists, covering every pair."""
    if len(src) != len(dst):
        raise ValueError("source and destination block lists differ in length")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _buffer(t: torch.Tensor) -> Any:
    """A UCX-sendable view sharing ``t``'s memory (numpy on CPU, CUDA array interface on GPU)."""
    flat = t.reshape(-1).view(torch.uint8)  # contiguous: reshape is a view, never a copy
    return flat if flat.is_cuda else flat.numpy()


def _fingerprint_diff(ours: dict, theirs: dict) -> str:
    keys = sorted(set(ours) | set(theirs))
    return ", ".join(
        f"{k}: {theirs.get(k)!r} vs {ours.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)
    )


def _pull_tag() -> int:
    # top bit clear: never equal to a control tag, which has it set; T+2 cannot overflow
    return secrets.randbits(62) << 1


def _control_tag() -> int:
    return (1 << 63) | secrets.randbits(63)


def format_address(control_tag: int, worker_address: bytes) -> str:
    """The text a server publishes: control tag and UCX worker address, opaque to everyone else."""
    return f"{ADDRESS_PREFIX}:{control_tag:016x}:{base64.b64encode(worker_address).decode()}"


def parse_address(text: str) -> tuple[int, bytes]:
    try:
        prefix, tag, addr = text.split(":", 2)
        if prefix != ADDRESS_PREFIX:
            raise ValueError(prefix)
        raw = base64.b64decode(addr, validate=True)
        if not 0 < len(raw) <= MAX_ADDRESS_BYTES:
            raise ValueError(len(raw))
        return int(tag, 16), raw
    except ValueError:
        raise KVTransferError(f"not a KV transfer address: {text[:40]!r}") from None


def _ucx_address(raw: bytes) -> Any:
    from ucxx._lib.libucxx import UCXAddress

    return UCXAddress.create_from_buffer(np.frombuffer(raw, dtype=np.uint8).copy())


def _own_address() -> bytes:
    import ucxx

    return bytes(ucxx.get_worker_address().tobytes())


def _unpack_request(data: bytes) -> dict:
    body = msgpack.unpackb(
        data,
        raw=False,
        max_bin_len=MAX_ADDRESS_BYTES,
        max_ext_len=0,
        max_map_len=16,
        strict_map_key=True,
    )
    if type(body) is not dict:
        raise ValueError("not a map")
    return body


def _pack_reply(error: str | None) -> np.ndarray:
    out = np.zeros(REPLY_BYTES, dtype=np.uint8)
    if error is None:
        out[0] = 1
    else:
        text = error.encode()[: REPLY_BYTES - 1]
        out[1 : 1 + len(text)] = np.frombuffer(text, dtype=np.uint8)
    return out


def _unpack_reply(reply: np.ndarray) -> str | None:
    if reply[0] == 1:
        return None
    return reply[1:].tobytes().rstrip(b"\0").decode(errors="replace") or "refused"


class _Endpoints:
    """One UCX endpoint per peer, least recently used dropped first.

    One, not a pool: UCX pairs the n-th endpoint a worker opens to a peer with the n-th the
    peer opens back, into one connection, so aborting an endpoint also ends its twin on the
    other side. With one endpoint per direction those twins are the same pair: a puller that
    aborts (to cancel its receives) thereby fails the server's sends to it at once.
    """

    def __init__(self, limit: int = MAX_PEERS) -> None:
        self.limit = limit
        self.eps: OrderedDict[bytes, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self.eps)

    async def get(self, raw: bytes) -> tuple[Any, bool]:
        """The endpoint to ``raw`` and whether it already existed."""
        import ucxx

        ucx_progress.driver()  # this event loop makes UCX progress (once per loop)
        ep = self.eps.get(raw)
        if ep is not None and not ep.closed:
            self.eps.move_to_end(raw)
            return ep, True
        ep = await ucxx.create_endpoint_from_worker_address(_ucx_address(raw))
        self.eps[raw] = ep
        self.eps.move_to_end(raw)
        while len(self.eps) > self.limit:
            _abort(self.eps.popitem(last=False)[1])
        return ep, False

    def drop(self, raw: bytes, ep: Any) -> None:
        """Abort ``ep``: everything still posted on it is cancelled."""
        if self.eps.get(raw) is ep:
            del self.eps[raw]
        _abort(ep)

    def clear(self) -> None:
        while self.eps:
            _abort(self.eps.popitem()[1])


def _retrieve(fut: asyncio.Future) -> None:
    """Mark an abandoned operation's outcome as seen (an aborted endpoint cancels them all)."""
    if not fut.cancelled():
        fut.exception()


def _abort(ep: Any) -> None:
    with contextlib.suppress(Exception):
        ep.abort()  # also cancels every receive still posted on it


# ---------------------------------------------------------------------------------------------
# leases (prefill side)


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expires: float  # unix seconds
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    pins: int = 0  # transfers reading the blocks right now
    dropped: bool = False  # released or expired while pinned: free after the last transfer
    on_drop: list[Callable[[], None]] = field(default_factory=list)  # transfers waiting on it


class LeaseTable:
    """Blocks a prefill worker holds for decode workers to pull.

    ``on_free(request_id)`` is called exactly once per lease, when it is released or expired and
    no transfer is reading it; the worker then returns the blocks to its engine. The tokens of
    the last ``remember`` dropped leases are kept, so a late puller can be told its lease is gone
    without answering anyone who never held a token. Used from one event loop only.
    """

    def __init__(
        self,
        on_free: Callable[[str], None],
        clock: Callable[[], float] = time.time,
        remember: int = 4096,
    ):
        self.on_free = on_free
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.remember = remember
        self.dropped_tokens: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self.leases)

    def add(self, request_id: str, block_ids: list[int], num_tokens: int, ttl: float) -> Lease:
        if request_id in self.leases:
            raise ValueError(f"lease for {request_id!r} exists")
        lease = Lease(request_id, list(block_ids), num_tokens, self.clock() + ttl)
        self.leases[request_id] = lease
        return lease

    def get(self, request_id: str) -> Lease | None:
        lease = self.leases.get(request_id)
        return None if lease is None or lease.dropped else lease

    def token_of(self, request_id: str) -> str | None:
        """The secret of a live or recently dropped lease."""
        lease = self.leases.get(request_id)
        return lease.token if lease is not None else self.dropped_tokens.get(request_id)

    def release(self, request_id: str) -> bool:
        """Drop a lease (pull done, cancel). False if there was none."""
        lease = self.leases.get(request_id)
        if lease is None or lease.dropped:
            return False
        lease.dropped = True
        for callback in list(lease.on_drop):
            callback()
        if lease.pins == 0:
            self._free(lease)
        return True

    def expire(self) -> list[str]:
        """Release every lease past its expiry; returns their request ids."""
        now = self.clock()
        gone = [
            rid for rid, lease in self.leases.items() if not lease.dropped and lease.expires < now
        ]
        for rid in gone:
            log.info("lease of %s expired unpulled; freeing its blocks", rid)
            self.release(rid)
        return gone

    def pin(self, lease: Lease) -> None:
        lease.pins += 1

    def unpin(self, lease: Lease) -> None:
        lease.pins -= 1
        if lease.pins == 0 and lease.dropped:
            self._free(lease)

    def _free(self, lease: Lease) -> None:
        if self.leases.pop(lease.request_id, None) is not None:
            self.dropped_tokens[lease.request_id] = lease.token
            while len(self.dropped_tokens) > self.remember:
                self.dropped_tokens.popitem(last=False)
            self.on_free(lease.request_id)


# ---------------------------------------------------------------------------------------------
# server (prefill side)


class KVServer:
    """Serves leased blocks of ``kv_cache`` to pullers that show the lease's token."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        leases: LeaseTable,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.fingerprint = dict(fingerprint)
        self.leases = leases
        self.host = host
        self.port = port
        self.control_tag = _control_tag()
        self.address = ""  # set by start(): what decode workers are told
        self.endpoints = _Endpoints()
        self._accept_task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self.bytes_served = 0
        self.pulls_served = 0
        self.pulls_refused = 0  # answered with a reason
        self.requests_dropped = 0  # malformed, unauthenticated or over the limit: not answered

    async def start(self) -> None:
        ucx_config.configure(self.host, self.port)
        self.address = format_address(self.control_tag, _own_address())
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
            req = _unpack_request(body)
        except Exception as exc:
            self._drop(repr(exc))
            return
        tag = req.get("tag")
        if type(tag) is not int or not 0 <= tag < 1 << 63:  # T+2 must fit in 64 bits
            self._drop("bad tag")
            return
        rid, reply_to = req.get("request_id"), req.get("reply_to")
        if not self._authentic(req):
            self._drop(f"no valid lease token for {str(rid)[:64]!r}")
            return
        lease, error = self._admit(req)
        ep = None
        try:
            ep, _ = await self.endpoints.get(reply_to)
            if lease is None:
                self.pulls_refused += 1
                await asyncio.wait_for(
                    ucx_progress.send(ep, _pack_reply(error), tag + 1), REPLY_TIMEOUT
                )
                return
            self.leases.pin(lease)
            try:
                views = [self.kv_cache[start : start + count] for start, count in req["runs"]]
                sends = [ucx_progress.send(ep, _pack_reply(None), tag + 1)]
                # every run in flight at once: UCX pipelines them, one tag keeps their order
                sends += [ucx_progress.send(ep, _buffer(v), tag + 2) for v in views]
                await self._send_all(asyncio.gather(*sends), lease)
            finally:
                self.leases.unpin(lease)
            self.bytes_served += sum(v.numel() * v.element_size() for v in views)
            self.pulls_served += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the puller went away or gave up mid-transfer
            log.info("KV pull of %s aborted: %r", rid, exc)
            if ep is not None:
                self.endpoints.drop(reply_to, ep)  # cancels whatever is still being sent

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
                sends.add_done_callback(_retrieve)  # cancelled with the endpoint, unread
                raise KVTransferError("the puller stopped receiving")
            sends.result()
        finally:
            lease.on_drop.remove(on_drop)

    def _authentic(self, req: dict) -> bool:
        """Whether the request shows the token of a live or recently dropped lease."""
        rid, token, reply_to = (req.get(k) for k in ("request_id", "token", "reply_to"))
        if type(rid) is not str or type(token) is not str or type(reply_to) is not bytes:
            return False
        expected = self.leases.token_of(rid)
        return expected is not None and hmac.compare_digest(expected, token)

    def _admit(self, req: dict) -> tuple[Lease | None, str | None]:
        """Check an authentic pull request completely before any KV byte moves."""
        rid, fp, runs = (req.get(k) for k in ("request_id", "fingerprint", "runs"))
        if type(fp) is not dict:
            return None, "malformed pull request"
        if fp != self.fingerprint:
            return None, f"KV layout mismatch ({_fingerprint_diff(self.fingerprint, fp)})"
        lease = self.leases.get(rid)
        if lease is None:
            return None, f"no lease for {rid} (expired or released)"
        if type(runs) is not list or not runs:
            return None, "malformed runs"
        leased = set(lease.block_ids)
        for run in runs:
            if (
                type(run) is not list
                or len(run) != 2
                or not all(type(x) is int for x in run)
                or run[1] < 1
                or not set(range(run[0], run[0] + run[1])) <= leased
            ):
                return None, "requested blocks are not part of the lease"
        return lease, None


# ---------------------------------------------------------------------------------------------
# client (decode side)


@dataclass
class _Pull:
    ep: Any
    receiving: bool = False  # receives into our blocks are posted and not all done


class KVClient:
    """Pulls KV handles into ``kv_cache``; keeps one endpoint per prefill worker."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        block_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.fingerprint = dict(fingerprint)
        self.block_size = block_size
        self.host = host
        self.port = port
        self.endpoints = _Endpoints()
        self._address: bytes | None = None

    def check(self, handle: KVHandle) -> None:
        """Raise FingerprintMismatch unless ``handle``'s layout equals ours."""
        if handle.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"KV layout of {handle.worker_id} differs "
                f"({_fingerprint_diff(self.fingerprint, handle.fingerprint)})"
            )

    def own_address(self) -> bytes:
        """Our UCX worker address, where servers send the KV (configures UCX on first use)."""
        if self._address is None:
            ucx_config.configure(self.host, self.port)
            self._address = _own_address()
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
        self, request_id: str, handle: KVHandle, dst_block_ids: list[int], timeout: float = 30.0
    ) -> TransferStats:
        """Copy the handle's first ``ceil(num_tokens / block_size)`` blocks into ``dst_block_ids``."""
        self.check(handle)
        n = blocks_for_tokens(handle.num_tokens, self.block_size)
        if len(handle.block_ids) < n or len(dst_block_ids) < n:
            raise KVTransferError(
                f"{n} blocks needed for {handle.num_tokens} tokens; handle has "
                f"{len(handle.block_ids)}, destination {len(dst_block_ids)}"
            )
        num_blocks = self.kv_cache.shape[0]
        if not all(0 <= b < num_blocks for b in dst_block_ids[:n]):
            raise KVTransferError("destination block id out of range")
        control_tag, raw = parse_address(handle.ucx_address)
        runs = block_runs(handle.block_ids[:n], dst_block_ids[:n])
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            ep, reused = await self.endpoints.get(raw)
            pull = _Pull(ep)
            try:
                stats = await asyncio.wait_for(
                    self._pull(pull, control_tag, request_id, handle, runs),
                    deadline - time.monotonic(),
                )
                break
            except asyncio.TimeoutError:
                if pull.receiving:  # receives point into our blocks: only an abort cancels them
                    self.endpoints.drop(raw, ep)
                raise KVTransferError(
                    f"KV pull from {handle.worker_id} timed out after {timeout}s"
                ) from None
            except KVTransferError:  # refused: nothing of ours is left posted
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
        request_id: str,
        handle: KVHandle,
        runs: list[tuple[int, int, int]],
    ) -> TransferStats:
        ep, tag = pull.ep, _pull_tag()
        body = msgpack.packb(
            {
                "request_id": request_id,
                "token": handle.token,
                "fingerprint": handle.fingerprint,
                "runs": [[s, n] for s, _, n in runs],
                "reply_to": self.own_address(),
                "tag": tag,
            },
            use_bin_type=True,
        )
        if len(body) > MAX_CONTROL_BYTES - 4:
            raise KVTransferError(f"pull request of {len(body)} bytes is too large")
        message = np.frombuffer(len(body).to_bytes(4, "little") + body, dtype=np.uint8)
        # The reply lands in a buffer of its own, so its receive may outlive a failed pull.
        reply = np.zeros(REPLY_BYTES, dtype=np.uint8)
        got_reply = asyncio.ensure_future(ucx_progress.recv(ep, reply, tag + 1))
        got_reply.add_done_callback(_retrieve)
        await asyncio.sleep(0)  # let it post its receive before we ask
        await asyncio.gather(ucx_progress.send(ep, message, control_tag), got_reply)
        error = _unpack_reply(reply)
        if error is not None:
            raise KVTransferError(f"{handle.worker_id} refused the pull: {error}")
        # Only now receive into our blocks: a refusal leaves nothing posted that points there.
        views = [self.kv_cache[dst : dst + count] for _, dst, count in runs]
        pull.receiving = True
        received = [
            asyncio.ensure_future(ucx_progress.recv(ep, _buffer(v), tag + 2)) for v in views
        ]
        for fut in received:
            fut.add_done_callback(_retrieve)
        await asyncio.gather(*received)
        pull.receiving = False
        return TransferStats(
            num_bytes=sum(v.numel() * v.element_size() for v in views), num_messages=len(views)
        )

    async def close(self) -> None:
        self.endpoints.clear()
