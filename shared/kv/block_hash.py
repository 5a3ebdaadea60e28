"""Chained block hashes of a token sequence: how prefix caches name their blocks.

A full block of ``block_size`` tokens is named by blake2b(parent block's hash + its tokens)
over a fixed byte encoding, so every process - workers storing blocks, the gateway's KV-aware
router predicting them - computes the same value for the same prefix, across restarts too.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    data = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
