"""How processes name KV blocks and the layouts that can exchange them.

A short, stable name for a KV-cache layout fingerprint (``LLMEngine.layout_fingerprint``).

Workers advertise theirs in every heartbeat (``WorkerLoad.kv_layout``); the gateway computes the
same name from a prefilled request's ``KVHandle.fingerprint``. So it pairs a prefill worker only
with decode workers that can pull its blocks - the same model, dtype, block size and KV-cache
element type - and a fleet in the middle of a change (say, to ``--kv-cache-dtype int8``) keeps
serving without failed pulls.

Chained block hashes of a token sequence name prefix-cache blocks.

A full block of ``block_size`` tokens is named by blake2b(parent block's hash + its tokens)
over a fixed byte encoding, so every process - workers storing blocks, the gateway's KV-aware
router predicting them - computes the same value for the same prefix, across restarts too.

A request's cache salt (``SamplingParams.cache_salt``: its tenant) names the chain's root, the
"parent" of its first block (``chain_root``): the first block's hash, and so every later one,
differs between salts. Everything that names blocks by hash - the pool's prefix cache on both
sides of P/D, KV events, the gateway's prefix index, the offload tiers (their disk file names)
and migration's recompute - then keeps tenants apart without knowing of salts. A salted first
block's KV event names that root as its parent, a hash no block has: a consumer that rebuilds
hashes from tokens alone cannot tie it to the unsalted chain.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence

from pdserve.shared.kv.tp_layout import without_tp


def layout_id(fingerprint: Mapping[str, object]) -> str:
    """16 hex digits naming what a puller must share with ``fingerprint``; equal on any host.

    Everything but the tensor-parallel size: head-sliced pulls move KV between any two TP
    layouts of one model (``tp_layout.py``), so a TP-2 prefill worker pairs with TP-1 decode
    workers, and the gateway routes by what can actually be pulled."""
    blob = json.dumps(
        without_tp(dict(fingerprint)), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


ROOT_HASH = 0  # the root of the unsalted chain


def chain_root(cache_salt: str | None) -> int:
    """The parent hash of a chain's first block: ROOT_HASH unsalted, else the salt's own (never
    ROOT_HASH: a salt cannot name the unsalted chain)."""
    if cache_salt is None:
        return ROOT_HASH
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"pdserve-salt")
    return int.from_bytes(digest.digest(), "little") or 1


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> int:
    """A block's hash. ``extra_keys`` (a prompt's first block only) name what besides the tokens
    the KV depends on - a LoRA adapter (``identity_keys``) - so equal tokens under another
    identity get another chain; with none, the bytes hashed are the same as ever."""
    data = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    if extra_keys:
        data += b"\0" + "\0".join(extra_keys).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def identity_keys(lora_name: str | None) -> tuple[str, ...]:
    """The first block's ``extra_keys`` of a request under ``lora_name`` (None: the base)."""
    return () if lora_name is None else (f"lora:{lora_name}",)


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: int = ROOT_HASH,
    *,
    extra_keys: Sequence[str] = (),
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, from ``root`` (``chain_root``: a
    tenant's salt); ``extra_keys`` are ``hash_block``'s (a LoRA adapter)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = extra_keys if start == 0 else ()
        parent = hash_block(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes
