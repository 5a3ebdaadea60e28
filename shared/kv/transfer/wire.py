"""What both ends of a KV pull agree on: tags, addresses, the request and reply formats, block
runs, and the endpoints kept per peer. See the package docstring for the exchange itself."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.shared.kv import ucx_progress

MAX_CONTROL_BYTES = 1 << 20  # a pull request lists runs, never data
MAX_ADDRESS_BYTES = 8192  # a UCX worker address: a few hundred bytes, more with many RDMA ports
REPLY_BYTES = 512
MAX_PENDING_REQUESTS = 256  # requests a server works on at once
MAX_PEERS = 1024  # peers whose endpoints are kept
ORPHAN_GRACE = 2.0  # seconds a transfer may run on after its puller let the lease go
REPLY_TIMEOUT = 5.0  # seconds a refusal may take to send
ADDRESS_PREFIX = "ucx1"
# The exchange's version, in every request ("v") and reply (a yes's byte 5; a refusal's first
# byte). 2: the puller posts all its receives before it asks and says which form it posted them
# for (whole blocks or head slices); a server answers in that form or refuses, and a refusal
# completes the posted receives with empty messages. 3: the request packs its fingerprint and
# its pull (form, heads, layers, runs) instead of mapping them (``request.py``); refusals say
# REPLY_REFUSED. 4: the request shows its lease's epoch (``epoch``), and the server refuses
# blocks reused since (``lease.py``). A server refuses other versions without empties (an older
# puller learns why, and aborts); a puller treats a refusal of another version as one to abort on.
KV_WIRE_VERSION = 4


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
    checksum_seconds: float = 0.0  # --kv-checksum: hashing what landed (part of ``seconds``)
    first_token: int | None = None  # a streamed pull's: what prefill sampled (stream.py)
    piece_seconds: list[float] = field(default_factory=list)  # ... when each piece was in

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


def buffer(t: torch.Tensor) -> Any:
    """A UCX-sendable view sharing ``t``'s memory (numpy on CPU, CUDA array interface on GPU)."""
    flat = t.reshape(-1).view(torch.uint8)  # contiguous: reshape is a view, never a copy
    return flat if flat.is_cuda else flat.numpy()


def fingerprint_diff(ours: dict, theirs: dict) -> str:
    keys = sorted(set(ours) | set(theirs))
    return ", ".join(
        f"{k}: {theirs.get(k)!r} vs {ours.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)
    )


_tags: list[int] = []  # drawn ahead, see pull_tag
os.register_at_fork(after_in_child=_tags.clear)  # a child draws its own


def pull_tag() -> int:
    """A pull's random tag. Top bit clear: never equal to a control tag, which has it set; T+2
    cannot overflow. Drawn 256 at a time: a draw each (a getrandom call) cost ~0.7 us, ~2 on
    the path of every pull, before its request can leave."""
    if not _tags:
        drawn = np.frombuffer(secrets.token_bytes(8 * 256), dtype="<u8")
        _tags.extend(((drawn & np.uint64((1 << 62) - 1)) << np.uint64(1)).tolist())
    return _tags.pop()


def control_tag() -> int:
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


def ucx_address(raw: bytes) -> Any:
    from ucxx._lib.libucxx import UCXAddress

    return UCXAddress.create_from_buffer(np.frombuffer(raw, dtype=np.uint8).copy())


def own_address() -> bytes:
    import ucxx

    return bytes(ucxx.get_worker_address().tobytes())


# The reply's first byte: a yes as whole blocks or head slices, or a refusal - 0 from a server
# before version 2, REPLY_REFUSED_2 from one of version 2, REPLY_REFUSED from this version's,
# which completes the puller's posted receives when the puller speaks it too.
REPLY_RAW, REPLY_SLICED, REPLY_REFUSED_2, REPLY_REFUSED = 1, 2, 3, 4


def pack_reply(
    error: str | None, sliced: bool = False, sums: int = 0, first_token: int | None = None
) -> np.ndarray:
    """A yes (``sums``: the checksums per block that follow on T+3, 0 for none; byte 5: the
    version; bytes 6-14: a streamed lease's first token, flag then u64, on its final piece) or
    a refusal (its reason from byte 1, as before versions)."""
    out = np.zeros(REPLY_BYTES, dtype=np.uint8)
    if error is None:
        out[0] = REPLY_SLICED if sliced else REPLY_RAW
        out[1:5] = np.frombuffer(sums.to_bytes(4, "little"), dtype=np.uint8)
        out[5] = KV_WIRE_VERSION
        if first_token is not None:
            out[6] = 1
            out[7:15] = np.frombuffer(int(first_token).to_bytes(8, "little"), dtype=np.uint8)
    else:
        out[0] = REPLY_REFUSED
        text = error.encode()[: REPLY_BYTES - 1]
        out[1 : 1 + len(text)] = np.frombuffer(text, dtype=np.uint8)
    return out


def reply_version(reply: np.ndarray) -> int:
    """The exchange version a reply speaks (0: a server from before versions)."""
    if reply[0] == REPLY_REFUSED:
        return KV_WIRE_VERSION
    if reply[0] == REPLY_REFUSED_2:
        return 2
    return int(reply[5]) if reply[0] in (REPLY_RAW, REPLY_SLICED) else 0


def unpack_reply(reply: np.ndarray) -> str | None:
    if reply[0] in (REPLY_RAW, REPLY_SLICED):
        return None
    return reply[1:].tobytes().rstrip(b"\0").decode(errors="replace") or "refused"


def reply_sums(reply: np.ndarray) -> int:
    """How many checksums per block a yes says follow on T+3 (``checksum.py``); 0: none."""
    return int.from_bytes(reply[1:5].tobytes(), "little") if unpack_reply(reply) is None else 0


def reply_leaves_posted(reply: np.ndarray) -> bool:
    """Whether a reply that has landed is a refusal from a server of another version, which
    completes none of the puller's other receives."""
    return int(reply[0]) not in (REPLY_RAW, REPLY_SLICED, REPLY_REFUSED)


def read_reply(reply: np.ndarray) -> tuple[str | None, int, bool, int, int | None]:
    """A landed reply at once, from one copy of its head: (refusal reason or None, version,
    sliced, checksums per block, first token) - what the functions above read one by one, at a
    numpy scalar per byte, while the puller is the last one still working on a pull."""
    head = reply[:15].tobytes()
    kind = head[0]
    if kind not in (REPLY_RAW, REPLY_SLICED):
        return unpack_reply(reply), reply_version(reply), False, 0, None
    first = int.from_bytes(head[7:15], "little") if head[6] == 1 else None
    sums = int.from_bytes(head[1:5], "little")
    return None, head[5], kind == REPLY_SLICED, sums, first


class Endpoints:
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

    async def get(self, raw: bytes) -> Any:
        """The endpoint to ``raw``: the kept one, or a new one."""
        import ucxx

        ucx_progress.driver()  # this event loop makes UCX progress (once per loop)
        ep = self.eps.get(raw)
        if ep is not None and not ep.closed:
            self.eps.move_to_end(raw)
            return ep
        ep = await ucxx.create_endpoint_from_worker_address(ucx_address(raw))
        self.eps[raw] = ep
        self.eps.move_to_end(raw)
        while len(self.eps) > self.limit:
            abort(self.eps.popitem(last=False)[1])
        return ep

    def cached(self, raw: bytes) -> Any:
        """The open endpoint to ``raw``, if one is kept (None: ``get`` must connect)."""
        ep = self.eps.get(raw)
        if ep is None or ep.closed:
            return None
        self.eps.move_to_end(raw)
        return ep

    def drop(self, raw: bytes, ep: Any) -> None:
        """Abort ``ep``: everything still posted on it is cancelled."""
        if self.eps.get(raw) is ep:
            del self.eps[raw]
        abort(ep)

    def clear(self) -> None:
        while self.eps:
            abort(self.eps.popitem()[1])


class BlockBytes:
    """Byte views of runs of whole blocks of a block-major cache, cheap enough to take one per
    block: a fragmented pull moves a message per block, and a torch slice plus ``buffer`` per
    message cost ~3 us each, a numpy slice of one byte view of a CPU cache ~0.3 us."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.block = cache[0].numel() * cache.element_size() if cache.shape[0] else 0
        flat = not cache.is_cuda and cache.is_contiguous()
        self.flat: np.ndarray | None = buffer(cache) if flat else None
        self.arrays: dict[int, Any] = {}  # see message
        self.limit = 4 * cache.shape[0] + 64

    def run(self, start: int, count: int) -> Any:
        if self.flat is None:
            return buffer(self.cache[start : start + count])
        return self.flat[start * self.block : (start + count) * self.block]

    def message(self, start: int, count: int) -> Any:
        """``run`` as the ucxx Array a post takes (``ucx_progress.array``), kept: the same runs
        of a cache travel again and again, and building one cost ~1 us (~2 on caches a copy
        has just flushed) on the path of every pull, on both sides. Only the runs seen last
        are kept (a key per start and count)."""
        key = start << 32 | count
        arr = self.arrays.get(key)
        if arr is None:
            if len(self.arrays) >= self.limit:
                self.arrays.clear()
            arr = self.arrays[key] = ucx_progress.array(self.run(start, count))
        return arr


def nbytes(buf: Any) -> int:
    """Size of a buffer ``buffer``, ``BlockBytes.run`` or ``.message`` gave (numpy, torch, or a
    ucxx Array)."""
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return buf.nbytes


def host_view(buf: Any) -> Any:
    """What a message's buffer shows torch (``torch.as_tensor``): a ucxx Array's object."""
    return buf if isinstance(buf, (np.ndarray, torch.Tensor)) else buf.obj


EMPTY = np.zeros(0, dtype=np.uint8)  # completes a posted receive without writing a byte


def retrieve(fut: asyncio.Future) -> None:
    """Mark an abandoned operation's outcome as seen (an aborted endpoint cancels them all)."""
    if not fut.cancelled():
        fut.exception()


def abort(ep: Any) -> None:
    with contextlib.suppress(Exception):
        ep.abort()  # also cancels every receive still posted on it
