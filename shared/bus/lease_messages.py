"""The KV handle and its lease on the bus: where a prefilled request's KV blocks wait, and the
message that lets them go.

A prefill worker hands a ``KVHandle`` out in its ``PrefillResult`` (and in the doctor's probe
replies); the gateway passes it on in the ``DecodeRequest``; the decode worker pulls with it and
then publishes ``ReleaseLease`` to ``{ns}.lease.{prefill}``. They live apart from the request
messages because the KV path (``shared/kv/``, the decode worker's pulls) needs the handle alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.shared.bus.wire_fields import (
    MAX_BLOCKS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_UCX_ADDRESS_CHARS,
    bounded,
    count,
    ident,
    seconds,
    text,
)


@dataclass
class KVHandle:
    """Where a prefilled request's KV blocks wait to be pulled, and under which lease."""

    worker_id: str = ident()
    # the prefill worker's KVServer.address: its UCX worker address and control tag, opaque
    ucx_address: str = text(max_len=MAX_UCX_ADDRESS_CHARS)
    block_ids: list[int] = bounded(lo=0, hi=MAX_TOKEN_ID, max_len=MAX_BLOCKS)
    num_tokens: int = count(lo=1, hi=MAX_TOKENS)
    # model, dtype, block_size, num_layers, num_kv_heads, head_dim: must equal the puller's
    fingerprint: dict[str, Any] = bounded(max_len=32)
    lease_expires: float = seconds()
    # Per-lease secret: the KV server answers only whoever shows it, so a peer that can reach
    # UCX but did not read the PrefillResult off the bus gets nothing, not even a reply.
    token: str = text(max_len=64, default="")
    # a prefill worker of TP > 1: every rank's KV server (rank 0's is ucx_address), by rank
    rank_addresses: list[str] = bounded(default=[], max_len=64)
    streaming: bool = bounded(default=False)  # still being written (kv/transfer/stream.py)
    ready_blocks: int = count(hi=MAX_BLOCKS, default=0)  # ... its first ones complete already
    # The lease's epoch: the highest generation among its blocks when it was taken (see
    # lease.py). A pull shows it, and blocks reused since are refused whatever else it shows.
    epoch: int = count(default=0)
    # the LoRA adapter its KV was computed under (None: the base model); a decode worker
    # refuses to pull it for a request under another adapter
    lora: str | None = text(max_len=256, default=None)


@dataclass
class ReleaseLease:
    TYPE: ClassVar[str] = "release_lease"
    bus_id: str = ident()
