"""Bounds and field helpers for the wire messages (``shared/bus/*_messages.py``).

A message field says what it may hold (``ident()``, ``tokens()``, ``count(lo, hi)``...) in its
dataclass metadata; the checker in ``pdserve.shared.bus.wire_check`` reads those bounds when it
decodes a message, so a bound is written once, next to the field it limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from pdserve.shared.bus.subjects import MAX_ID_CHARS, SUBJECT_RE, TOKEN_RE
from pdserve.shared.bus.wire_check import INT64_MAX
from pdserve.shared.sampling import BOUNDS as SAMPLING_BOUNDS
from pdserve.shared.sampling import (
    GUIDED_KINDS,
    MAX_CACHE_SALT_CHARS,
    MAX_GUIDED_SPEC_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    MIN_LOGPROB,
    REASONING_STARTS,
)

# Bounds that hold for any sane deployment; the bus also caps whole messages (max_message_bytes).
MAX_SUBJECT_CHARS = 256
MAX_TEXT_CHARS = 4096
MAX_UCX_ADDRESS_CHARS = 12000  # base64 of a UCX worker address (<= 8 KiB) and a tag
MAX_TOKENS = 1 << 20  # prompt/output token lists
MAX_BLOCKS = 1 << 20
MAX_BATCH_ITEMS = 4096
MAX_TOKEN_ID = (1 << 31) - 1
MAX_DEPTH = 8
# Block hashes per KVEvents message (9 msgpack bytes each: ~590 KB, under NATS's default 1 MB
# payload limit); bigger changes and snapshots are split over several messages.
MAX_KV_EVENT_HASHES = 1 << 16
# Token ids per KVEvents message (a stored block's tokens ride with it, <= 5 msgpack bytes each:
# ~330 KB); the publisher splits deltas so hashes and tokens together stay under ~1 MB.
MAX_KV_EVENT_TOKENS = 1 << 16
MAX_ADAPTER_CHARS = 256  # a LoRA adapter's name (--lora-modules NAME=...)
UINT64_MAX = (1 << 64) - 1  # block hashes are unsigned 64-bit (blake2b, 8 bytes)


# ---------------------------------------------------------------------------------------------
# field helpers: bounds live in dataclass field metadata, read by shared.wire_check's Checker


def bounded(default: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=bounds)
    return field(default=default, metadata=bounds)


def ident(**kw: Any) -> Any:
    """A request/worker id: one NATS subject token."""
    return bounded(kw.pop("default", dataclasses.MISSING), pattern=TOKEN_RE, max_len=MAX_ID_CHARS)


def subject(**kw: Any) -> Any:
    return bounded(
        kw.pop("default", dataclasses.MISSING), pattern=SUBJECT_RE, max_len=MAX_SUBJECT_CHARS
    )


def text(max_len: int = MAX_TEXT_CHARS, **kw: Any) -> Any:
    return bounded(kw.pop("default", dataclasses.MISSING), max_len=max_len, **kw)


def count(lo: int = 0, hi: int = INT64_MAX, **kw: Any) -> Any:
    return bounded(kw.pop("default", dataclasses.MISSING), lo=lo, hi=hi)


def tokens(max_len: int = MAX_TOKENS, **kw: Any) -> Any:
    return bounded(kw.pop("default", dataclasses.MISSING), lo=0, hi=MAX_TOKEN_ID, max_len=max_len)


def seconds(**kw: Any) -> Any:
    return bounded(kw.pop("default", dataclasses.MISSING), lo=0.0, hi=1e12)


def amount(**kw: Any) -> Any:
    """A finite non-negative total (FLOPs, bytes, seconds since start), 0 by default."""
    return bounded(kw.pop("default", 0.0), lo=0.0)


# The nested classes' bounds (shared.sampling's, which carry none in their field metadata).
# SamplingParams' bounds are written once, in shared.sampling; the class itself refuses what
# its bounds' open ends and special values (top_k 0) exclude.
SAMPLING_FIELD_BOUNDS: dict[str, dict[str, Any]] = {
    **{name: {"lo": b.lo, "hi": b.hi} for name, b in SAMPLING_BOUNDS.items()},
    "stop_token_ids": {"lo": 0, "hi": MAX_TOKEN_ID, "max_len": MAX_STOP_TOKEN_IDS},
    "ignore_eos": {},
    "logit_bias_token_ids": {"lo": 0, "hi": MAX_TOKEN_ID, "max_len": MAX_LOGIT_BIAS},
    "logit_bias_values": {
        "lo": -MAX_LOGIT_BIAS_VALUE,
        "hi": MAX_LOGIT_BIAS_VALUE,
        "max_len": MAX_LOGIT_BIAS,
    },
    "guided": {},
    "speculate": {},
    "cache_salt": {"max_len": MAX_CACHE_SALT_CHARS},
}
GUIDED_FIELD_BOUNDS: dict[str, dict[str, Any]] = {
    "kind": {"choices": GUIDED_KINDS, "max_len": 16},
    "spec": {"max_len": MAX_GUIDED_SPEC_CHARS},
    "reasoning": {"choices": REASONING_STARTS, "max_len": 8},
}
LOGPROB_FIELD_BOUNDS: dict[str, dict[str, Any]] = {
    "top_k": {"lo": 0, "hi": MAX_LOGPROBS},
    "token_logprobs": {"lo": MIN_LOGPROB, "hi": 0.0},
    "ranks": {"lo": 1, "hi": MAX_TOKEN_ID},
    "top_token_ids": {"lo": 0, "hi": MAX_TOKEN_ID},
    "top_logprobs": {"lo": MIN_LOGPROB, "hi": 0.0},
}
