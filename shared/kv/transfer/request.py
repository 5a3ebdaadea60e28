"""A pull request on the wire (``wire.KV_WIRE_VERSION`` 4): u32 length, then a msgpack map.

The map carries who asks - ``v``, ``bus_id``, ``token``, ``reply_to`` (the puller's UCX
address), ``tag`` - as every version did, and the lease's ``epoch`` (its blocks' generation
when leased: blocks reused since are refused), so a server of another version still reads enough to
authenticate the puller and refuse it with the reason. The rest is packed, not mapped:

- ``fp``: the puller's layout fingerprint as msgpack bytes, packed once per puller; a server
  compares the bytes with the last ones that matched and decodes them only when they differ;
- ``pull``: ``<BHHHH`` flags (``WHOLE``, ``SLICED``, ``CHECKSUM``, ``PIECE``, ``FINAL``), heads
  ``[lo, hi)``, a streamed piece's layers ``[lo, hi)``, then ``<II`` (source block, count) per
  run.

Version 2 sent the fingerprint and runs as msgpack maps and lists: ~30 objects to build and
check per pull on each side, ~2 us of Python before the KV could move, on caches its copy had
flushed (issue 29).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from pdserve.shared.kv.transfer.wire import (
    KV_WIRE_VERSION,
    MAX_ADDRESS_BYTES,
    MAX_CONTROL_BYTES,
    KVTransferError,
)

WHOLE, SLICED, CHECKSUM, PIECE, FINAL = 1, 2, 4, 8, 16
_HEAD = struct.Struct("<BHHHH")
_RUN = struct.Struct("<II")  # a run: u32 source block, u32 count
_FIXED = 3  # entries of the prefix: v, reply_to, fp


def request_prefix(reply_to: bytes, fingerprint: dict) -> bytes:
    """The entries that stay the same from pull to pull, packed once as a map of their own."""
    fp = msgpack.packb(fingerprint, use_bin_type=True)
    return msgpack.packb({"v": KV_WIRE_VERSION, "reply_to": reply_to, "fp": fp})


def encode_request(
    prefix: bytes,
    bus_id: str,
    token: str,
    tag: int,
    flags: int,
    heads: tuple[int, int],
    layers: tuple[int, int],
    runs: list[tuple[int, int, int]],
    epoch: int = 0,
) -> bytes:
    """The request message; ``runs``: (source start, destination start, count) each. Both
    parts are fixmaps (at most 15 entries, the header one byte: 0x80 | count), so the prefix's
    entries are spliced in: a map's entries may come in any order."""
    try:
        pull = _HEAD.pack(flags, heads[0], heads[1], layers[0], layers[1]) + b"".join(
            [_RUN.pack(s, n) for s, _, n in runs]
        )
    except struct.error as exc:  # a block id or head beyond the format's range
        raise ValueError(f"cannot encode the pull request: {exc}") from None
    varying = msgpack.packb(
        {"bus_id": bus_id, "token": token, "tag": tag, "pull": pull, "epoch": epoch}
    )
    body = bytes([0x80 | (_FIXED + 5)]) + prefix[1:] + varying[1:]
    return len(body).to_bytes(4, "little") + body


class RequestWriter:
    """One puller's requests: the entries that stay the same from pull to pull (version, its
    address, the fingerprint) are packed once per fingerprint. A request that cannot be encoded,
    or is too large for the server's receive, raises KVTransferError."""

    def __init__(self) -> None:
        self._prefix: tuple[dict, bytes] | None = None

    def write(
        self,
        reply_to: bytes,
        bus_id: str,
        handle: Any,
        *,
        tag: int,
        flags: int,
        heads: tuple[int, int],
        layers: tuple[int, int],
        runs: list[tuple[int, int, int]],
    ) -> bytes:
        """The request for ``handle``'s (a ``KVHandle``) blocks, for ``encode_request``."""
        if self._prefix is None or self._prefix[0] != handle.fingerprint:
            self._prefix = (dict(handle.fingerprint), request_prefix(reply_to, handle.fingerprint))
        try:
            message = encode_request(
                self._prefix[1],
                bus_id,
                handle.token,
                tag,
                flags,
                heads,
                layers,
                runs,
                epoch=handle.epoch,
            )
        except ValueError as exc:
            raise KVTransferError(str(exc)) from None
        if len(message) > MAX_CONTROL_BYTES:
            raise KVTransferError(f"pull request of {len(message)} bytes is too large")
        return message


class PullRequest:
    """A decoded request: who asks (checked by ``decode_request``), and what (``parse``)."""

    __slots__ = (
        "version",
        "bus_id",
        "token",
        "reply_to",
        "tag",
        "epoch",
        "fingerprint",
        "pull",
        "flags",
        "heads",
        "layers",
        "runs",
    )

    def __init__(self, entries: dict) -> None:
        self.version = entries.get("v")
        self.bus_id = entries.get("bus_id")
        self.token = entries.get("token")
        self.reply_to = entries.get("reply_to")
        self.tag = entries.get("tag")
        self.epoch = entries.get("epoch")
        self.fingerprint = entries.get("fp")
        self.pull = entries.get("pull")
        self.flags = 0
        self.heads: tuple[int, int] = (0, 0)
        self.layers: tuple[int, int] | None = None
        self.runs: list[tuple[int, int]] | None = None  # set by parse

    @property
    def checksum(self) -> bool:
        return bool(self.flags & CHECKSUM)

    @property
    def final(self) -> bool:
        return bool(self.flags & FINAL)

    def parse(self) -> None:
        """Read ``pull`` (flags, heads, layers, runs), or raise ValueError with the reason."""
        pull = self.pull
        if type(pull) is not bytes or len(pull) < _HEAD.size + _RUN.size:
            raise ValueError("no runs")
        if (len(pull) - _HEAD.size) % _RUN.size:
            raise ValueError("runs cut short")
        if type(self.epoch) is not int or self.epoch < 0:
            raise ValueError("no lease epoch")
        flags, lo, hi, first, last = _HEAD.unpack_from(pull)
        self.runs = list(_RUN.iter_unpack(pull[_HEAD.size :]))
        self.flags, self.heads = flags, (lo, hi)
        self.layers = (first, last) if flags & PIECE else None


def decode_request(body: Any) -> PullRequest:
    """Decode a request, or raise ValueError unless it says who asks: a request that does not
    is never answered (its sender may be anyone)."""
    entries = msgpack.unpackb(
        body,
        raw=False,
        max_bin_len=MAX_CONTROL_BYTES,
        max_ext_len=0,
        max_map_len=16,
        strict_map_key=True,
    )
    if type(entries) is not dict:
        raise ValueError("not a map")
    req = PullRequest(entries)
    if type(req.bus_id) is not str or type(req.token) is not str:
        raise ValueError("no lease token")
    if type(req.reply_to) is not bytes or not 0 < len(req.reply_to) <= MAX_ADDRESS_BYTES:
        raise ValueError("no reply address")
    if type(req.tag) is not int or not 0 <= req.tag < 1 << 63:  # T+3 must fit in 64 bits
        raise ValueError("bad tag")
    return req
