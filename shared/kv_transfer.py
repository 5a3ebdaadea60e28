"""KV-cache transfer over UCX (ucxx): the decode worker pulls a prefill worker's leased blocks
straight into blocks it allocated in its own cache.

The engine's cache is one block-major tensor ``[num_blocks, layers, 2, block_size, kv_heads,
head_dim]``, so a run of consecutive block ids is one contiguous byte range on either side. A pull
pairs source and destination ids, cuts the pairs into runs that are consecutive on *both* sides,
and moves each run as a single UCX message - no per-layer or per-token chatter.

One pull on an endpoint (the decode worker keeps one per prefill worker, used by one pull at a
time)::

    decode -> prefill   u64 length + msgpack {request_id, token, fingerprint, runs: [[src, n]..]}
    prefill -> decode   u64 length + msgpack {ok, error}
    prefill -> decode   one message per run, straight from / into the cache tensors

The puller checks the layout fingerprint before it connects and the server checks it again
before any byte moves; the server also checks the lease's secret token and that every requested
block belongs to that lease. Leased blocks are pinned while they are being sent, so a lease that
expires mid-transfer is freed only after the last byte left.

Exposure: ucxx has no bind-address parameter - its listener (and UCX's TCP transport) listen on
every interface, whatever ``--ucx-host`` says; ``--ucx-host`` is only the address peers are told
to use. What keeps others out is the per-lease secret, which travels only on the (authenticated)
bus; on untrusted networks firewall the UCX ports as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from shared.protocol import KVHandle

log = logging.getLogger("pdserve.kv")

MAX_CONTROL_BYTES = 1 << 20  # a pull request lists runs, never data


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


async def _send_control(ep: Any, body: dict) -> None:
    data = np.frombuffer(msgpack.packb(body, use_bin_type=True), dtype=np.uint8)
    await ep.send(np.array([data.size], dtype=np.uint64))
    await ep.send(data)


async def _recv_control(ep: Any) -> dict:
    size = np.empty(1, dtype=np.uint64)
    await ep.recv(size)
    n = int(size[0])
    if not 0 < n <= MAX_CONTROL_BYTES:
        raise KVTransferError(f"control message of {n} bytes")
    data = np.empty(n, dtype=np.uint8)
    await ep.recv(data)
    body = msgpack.unpackb(
        data.tobytes(), raw=False, max_bin_len=0, max_ext_len=0, max_map_len=16, strict_map_key=True
    )
    if type(body) is not dict:
        raise KVTransferError("control message is not a map")
    return body


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


class LeaseTable:
    """Blocks a prefill worker holds for decode workers to pull.

    ``on_free(request_id)`` is called exactly once per lease, when it is released or expired and
    no transfer is reading it; the worker then returns the blocks to its engine. Used from one
    event loop only.
    """

    def __init__(self, on_free: Callable[[str], None], clock: Callable[[], float] = time.time):
        self.on_free = on_free
        self.clock = clock
        self.leases: dict[str, Lease] = {}

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

    def release(self, request_id: str) -> bool:
        """Drop a lease (pull done, cancel). False if there was none."""
        lease = self.leases.get(request_id)
        if lease is None or lease.dropped:
            return False
        lease.dropped = True
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
            self.on_free(lease.request_id)


# ---------------------------------------------------------------------------------------------
# server (prefill side)


class KVServer:
    """Serves leased blocks of ``kv_cache`` to pullers over a ucxx listener."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        leases: LeaseTable,
        advertise_host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.fingerprint = dict(fingerprint)
        self.leases = leases
        self.advertise_host = advertise_host
        self.requested_port = port
        self.listener: Any = None
        self._endpoints: set[Any] = set()
        self.bytes_served = 0
        self.pulls_served = 0
        self.pulls_refused = 0

    @property
    def port(self) -> int:
        return self.listener.port if self.listener is not None else 0

    async def start(self) -> None:
        import ucxx

        # ucxx listens on every interface; the advertised host is what peers are told to use.
        self.listener = ucxx.create_listener(self._serve, port=self.requested_port or None)
        log.info(
            "KV transfer listening on port %d of every interface (ucxx cannot bind one); "
            "advertised as %s; pulls need a lease token",
            self.port,
            self.advertise_host,
        )

    async def stop(self) -> None:
        for ep in list(self._endpoints):
            with contextlib.suppress(Exception):
                ep.abort()
        # let the aborted handlers unwind before the listener goes
        for _ in range(100):
            if not self._endpoints:
                break
            await asyncio.sleep(0.01)
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    async def _serve(self, ep: Any) -> None:
        self._endpoints.add(ep)
        try:
            while True:
                try:
                    req = await _recv_control(ep)
                except Exception:  # peer closed or sent junk: drop the connection
                    return
                lease, error = self._admit(req)
                if lease is None:
                    self.pulls_refused += 1
                    await _send_control(ep, {"ok": False, "error": error})
                    continue
                self.leases.pin(lease)
                try:
                    await _send_control(ep, {"ok": True, "error": None})
                    views = [self.kv_cache[start : start + count] for start, count in req["runs"]]
                    # all runs in flight at once: UCX pipelines them (tags keep their order)
                    await asyncio.gather(*(ep.send(_buffer(v)) for v in views))
                    self.bytes_served += sum(v.numel() * v.element_size() for v in views)
                    self.pulls_served += 1
                except Exception as exc:  # the puller went away mid-transfer
                    log.info("KV pull of %s aborted: %r", lease.request_id, exc)
                    return
                finally:
                    self.leases.unpin(lease)
        finally:
            self._endpoints.discard(ep)
            with contextlib.suppress(Exception):
                await ep.close()

    def _admit(self, req: dict) -> tuple[Lease | None, str | None]:
        """Check a pull request completely before any KV byte moves."""
        rid, token, fp, runs = (req.get(k) for k in ("request_id", "token", "fingerprint", "runs"))
        if type(rid) is not str or type(token) is not str or type(fp) is not dict:
            return None, "malformed pull request"
        if fp != self.fingerprint:
            return None, f"KV layout mismatch ({_fingerprint_diff(self.fingerprint, fp)})"
        lease = self.leases.get(rid)
        if lease is None:
            return None, f"no lease for {rid} (expired or released)"
        if not hmac.compare_digest(lease.token, token):
            return None, "wrong lease token"
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
class _Peer:
    ep: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class KVClient:
    """Pulls KV handles into ``kv_cache``; keeps one endpoint per prefill worker."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: dict,
        block_size: int,
        connect_timeout: float = 5.0,
    ) -> None:
        self.kv_cache = kv_cache
        self.connect_timeout = connect_timeout
        self.fingerprint = dict(fingerprint)
        self.block_size = block_size
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}

    def check(self, handle: KVHandle) -> None:
        """Raise FingerprintMismatch unless ``handle``'s layout equals ours."""
        if handle.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"KV layout of {handle.worker_id} differs "
                f"({_fingerprint_diff(self.fingerprint, handle.fingerprint)})"
            )

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
        runs = block_runs(handle.block_ids[:n], dst_block_ids[:n])
        key = (handle.address, handle.port)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            reused = key in self._peers
            try:
                stats = await asyncio.wait_for(
                    self._pull(key, request_id, handle, runs), deadline - time.monotonic()
                )
                break
            except asyncio.TimeoutError:
                await self._drop(key)  # the stream's state is unknown now
                raise KVTransferError(
                    f"KV pull from {handle.worker_id} timed out after {timeout}s"
                ) from None
            except KVTransferError:
                raise
            except Exception as exc:
                await self._drop(key)
                if reused:  # a kept endpoint went stale (peer restarted): one fresh try
                    log.info("endpoint to %s was stale (%r); reconnecting", handle.worker_id, exc)
                    continue
                raise KVTransferError(f"KV pull from {handle.worker_id} failed: {exc!r}") from exc
        stats.seconds = time.perf_counter() - t0
        stats.num_blocks = n
        return stats

    async def _pull(
        self,
        key: tuple[str, int],
        request_id: str,
        handle: KVHandle,
        runs: list[tuple[int, int, int]],
    ) -> TransferStats:
        peer = await self._peer(key)
        stats = TransferStats()
        async with peer.lock:
            await _send_control(
                peer.ep,
                {
                    "request_id": request_id,
                    "token": handle.token,
                    "fingerprint": handle.fingerprint,
                    "runs": [[s, n] for s, _, n in runs],
                },
            )
            reply = await _recv_control(peer.ep)
            if reply.get("ok") is not True:
                raise KVTransferError(f"{handle.worker_id} refused the pull: {reply.get('error')}")
            views = [self.kv_cache[dst : dst + count] for _, dst, count in runs]
            # receives are posted in run order, and messages of one tag match in send order
            await asyncio.gather(*(peer.ep.recv(_buffer(v)) for v in views))
            stats.num_bytes = sum(v.numel() * v.element_size() for v in views)
            stats.num_messages = len(views)
        return stats

    async def _peer(self, key: tuple[str, int]) -> _Peer:
        import ucxx

        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            peer = self._peers.get(key)
            if peer is None or peer.ep.closed:
                ep = await ucxx.create_endpoint(
                    key[0], key[1], connect_timeout=self.connect_timeout
                )
                peer = self._peers[key] = _Peer(ep)
            return peer

    async def _drop(self, key: tuple[str, int]) -> None:
        peer = self._peers.pop(key, None)
        if peer is not None:
            with contextlib.suppress(Exception):
                peer.ep.abort()

    async def close(self) -> None:
        for key in list(self._peers):
            peer = self._peers.pop(key)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(peer.ep.close(), 2.0)
