"""One KV block on disk: a file named by its block hash and the identity it was written under.

``<block hash, 16 hex>.<identity>.kv`` holds a 48-byte header, then the block's bytes exactly as
the pool stores them (values, then a quantized cache's scales)::

    magic "PDKV" | version u16 | header bytes u16 | identity (16 bytes) | block hash u64
    | payload bytes u64 | xxh3-64 of the payload u64

The identity is the layout id (``shared/kv/layout.layout_id`` of the engine's fingerprint:
model name, dtype, block size, geometry, KV element type and scale layout, 16 hex) followed by
the digest of the model's weights (``weights_digest.py``, 16 hex), so a block written by another
layout or another checkpoint of the same name and shape is never read as ours (an identity of
the layout alone, as the unit tests use, is zero-padded in the header). The checksum is the KV
path's own hash (``shared/kv/transfer/checksum.digest``).
A file is written under a temporary name and renamed into place, so a reader sees a whole file
or none; a crash mid-write leaves only a ``.tmp`` file, which the next scan removes. What the
rename cannot promise (a torn page after a power cut, a flipped bit) the checksum catches.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from pdserve.shared.kv.transfer.checksum import digest

MAGIC = b"PDKV"
VERSION = 2  # 1: an 8-byte layout id, no weights digest
HEADER = struct.Struct("<4sHH16sQQQ")
IDENTITY_BYTES = 16
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class BadBlockFile(Exception):
    """A block file that must not be served. ``kind``: "torn" (short, or a leftover temporary),
    "corrupt" (bad header or checksum) - both removed - or "foreign" (another identity's: left
    alone, it may be another engine's)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


def identity_bytes(identity: str) -> bytes:
    raw = bytes.fromhex(identity)
    if len(raw) > IDENTITY_BYTES:
        raise ValueError(f"a disk identity of {len(raw)} bytes: at most {IDENTITY_BYTES}")
    return raw.ljust(IDENTITY_BYTES, b"\0")


def file_name(block_hash: int, layout: str) -> str:
    return f"{block_hash:016x}.{layout}{SUFFIX}"


def parse_name(name: str, layout: str) -> int | None:
    """The block hash a file of ``layout`` is named by, or None for any other file."""
    tail = f".{layout}{SUFFIX}"
    if not name.endswith(tail) or len(name) != 16 + len(tail):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


def file_size(block_bytes: int) -> int:
    return HEADER.size + block_bytes


def write_block(path: Path, layout: str, block_hash: int, payload: np.ndarray) -> None:
    """Write ``payload`` (the block's bytes) to ``path``: a temporary name first, then a rename."""
    header = HEADER.pack(
        MAGIC,
        VERSION,
        HEADER.size,
        identity_bytes(layout),
        block_hash,
        payload.nbytes,
        digest(payload),
    )
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(memoryview(payload).cast("B"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_header(raw: bytes, size: int, layout: str, block_hash: int, block_bytes: int) -> int:
    """The checksum a file's header (``raw``, of a file of ``size`` bytes) promises, after
    checking that the file is a whole block of ``layout`` named ``block_hash``."""
    if len(raw) < HEADER.size:
        raise BadBlockFile("torn", f"{size} bytes: shorter than a header")
    magic, version, header_size, lid, h, length, checksum = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or header_size != HEADER.size:
        raise BadBlockFile("corrupt", "not a pdserve KV block file of this version")
    if lid != identity_bytes(layout):
        what = "model weights" if lid[:8] == identity_bytes(layout)[:8] else "KV layout"
        raise BadBlockFile("foreign", f"written under other {what} ({lid.hex()}, not {layout})")
    if h != block_hash:
        raise BadBlockFile("corrupt", f"holds block {h:016x}, not the one it is named by")
    if length != block_bytes:
        raise BadBlockFile("corrupt", f"a {length}-byte block, not {block_bytes}")
    if size != HEADER.size + length:
        raise BadBlockFile("torn", f"{size} bytes, the header says {HEADER.size + length}")
    return checksum


def scan_header(path: Path, layout: str, block_hash: int, block_bytes: int) -> int:
    """Check a file's header and length without reading its payload (the start-up scan);
    returns its size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        check_header(f.read(HEADER.size), size, layout, block_hash, block_bytes)
    return size


def read_block(path: Path, layout: str, block_hash: int, block_bytes: int) -> np.ndarray:
    """The block's bytes, once header, length and checksum all agree (else BadBlockFile)."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)  # writable: torch takes it without a copy
        del data[f.readinto(data) :]  # a file cut meanwhile reads short: torn
    checksum = check_header(data[: HEADER.size], len(data), layout, block_hash, block_bytes)
    payload = np.frombuffer(data, dtype=np.uint8, offset=HEADER.size)
    if digest(payload) != checksum:
        raise BadBlockFile("corrupt", "the payload fails its xxh3 checksum")
    return payload
