"""The wire protocol between gateway and workers: msgpack maps with a version and a type.

Every message is a dataclass below. ``encode`` turns one into bytes; ``decode`` parses bytes from
the bus and checks every field's type and bounds before a message object exists, so code behind
it can trust what it gets. Anything else - an unknown type or version, a missing or extra field,
a wrong type, an oversized string or list, a non-finite float - raises ``ProtocolError``.
msgpack never instantiates objects, and nothing is ever unpickled.

Flow of one request (subjects from ``Subjects``):
  gateway  -PrefillRequest->  {ns}.prefill.{worker}      prefill replies PrefillResult to reply_to
  gateway  -DecodeRequest->   {ns}.decode.{worker}       decode streams TokenBatch to reply_to
  gateway  -StreamCheck->     {ns}.decode.{worker}       after a gap or reconnect; answered in-stream
  decode   -ReleaseLease->    {ns}.lease.{prefill}       after pulling the KV (or giving up)
  gateway  -Cancel->          {ns}.cancel                broadcast; every worker drops the request
  workers  -WorkerLoad->      {ns}.load.{role}.{worker}  heartbeats; WorkerGone when leaving
  workers  -KVEvents->        {ns}.kv.{worker}           prefix-cache changes and snapshots
  gateway  -(empty request)-> {ns}.ping.{worker}         answered with a WorkerLoad (liveness)
  doctor   -Probe*Request->   {ns}.probe.{worker}        request/reply, types in shared/kv/probe.py
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from pdserve.shared.bus.wire_check import Checker, ProtocolError
from pdserve.shared.bus.wire_fields import (
    GUIDED_FIELD_BOUNDS,
    LOGPROB_FIELD_BOUNDS,
    MAX_BATCH_ITEMS,
    MAX_BLOCKS,
    MAX_DEPTH,
    MAX_KV_EVENT_HASHES,
    MAX_KV_EVENT_TOKENS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_UCX_ADDRESS_CHARS,
    SAMPLING_FIELD_BOUNDS,
    UINT64_MAX,
    amount,
    bounded,
    count,
    ident,
    seconds,
    subject,
    text,
    tokens,
)
from pdserve.shared.sampling import MAX_N, GuidedDecoding, SamplingParams, TokenLogprobs

PROTOCOL_VERSION = 10  # 3: n choices, log-probs, penalties, structured output; 4: positions;
# 5: one name per id (bus_id on the bus, client_id for the x-request-id); 6: TP ranks' KV servers
# 7: WorkerLoad's roofline totals and peaks; 8: KVEvents per KV tier, WorkerLoad's tier load costs
# 9: KV events' parents, token ids and clears; WorkerLoad's standby state and model version;
# 10: layer-wise KV streaming (PrefillRequest.stream_kv, KVHandle.streaming, kv_stream)

ROLES = ("prefill", "decode")
# where a worker holds a KV block: its device pool, then the offload tiers (issue 33), fastest first
KV_TIERS = ("device", "host", "disk")
FINISH_REASONS = ("stop", "length", "abort", "error")
# error_code values workers send (free text on the wire, so a newer worker may add codes):
ERROR_CODES = {
    "overloaded": "the worker's queue is full (retry elsewhere)",
    "draining": "the worker is shutting down (retry elsewhere)",
    "deadline": "the request's deadline passed in this worker before its first token",
    "invalid": "this model cannot serve the request (too long, token id out of range...)",
    "kv_transfer": "the decode worker could not pull the KV (policy fail)",
    "internal": "a bug or an unexpected fault",
    "unknown": "answers a StreamCheck: the decode worker has no such request (over, or lost)",
}


# ---------------------------------------------------------------------------------------------
# messages


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


@dataclass
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill_request"
    bus_id: str = ident()
    prompt_token_ids: list[int] = tokens()
    sampling: SamplingParams = bounded()
    reply_to: str = subject()
    deadline: float = seconds()
    # the client's x-request-id: the bus id above is the gateway's own (unique), this one names
    # the request on spans and in logs, where people look it up
    client_id: str | None = ident(default=None)
    stream_kv: bool = bounded(default=False)  # may lease early: kv/transfer/stream.py


@dataclass
class PrefillResult:
    TYPE: ClassVar[str] = "prefill_result"
    bus_id: str = ident()
    worker_id: str = ident()
    first_token: int | None = count(hi=MAX_TOKEN_ID)
    finish_reason: str | None = text(max_len=16, choices=FINISH_REASONS)
    kv: KVHandle | None = bounded()
    error: str | None = text()
    cached_tokens: int = count(hi=MAX_TOKENS, default=0)
    # machine-readable error kind (ERROR_CODES); the gateway retries "overloaded"/"draining"
    error_code: str | None = text(max_len=32, default=None)
    first_logprobs: TokenLogprobs | None = bounded(default=None)  # of first_token (logprobs asked)
    # of the prompt's tokens after the first (prompt_logprobs asked): computed in the prefill
    prompt_logprobs: TokenLogprobs | None = bounded(default=None)

    @classmethod
    def failure(cls, bus_id: str, worker_id: str, code: str, error: str) -> PrefillResult:
        """The prefill of ``bus_id`` ended with an error (``code``: see ERROR_CODES)."""
        return cls(bus_id, worker_id, None, "error", None, error, 0, code)


@dataclass
class DecodeRequest:
    TYPE: ClassVar[str] = "decode_request"
    bus_id: str = ident()
    prompt_token_ids: list[int] = tokens()
    output_token_ids: list[int] = tokens()  # already generated, e.g. [first_token]
    sampling: SamplingParams = bounded()
    kv: KVHandle | None = bounded()  # None: the decode worker prefills locally
    reply_to: str = subject()
    # the first token's: a worker drops the request when it passes before then (queued,
    # pulling, prefilling), never once it streams - the gateway judges stalls from there
    deadline: float = seconds()
    client_id: str | None = ident(default=None)  # as in PrefillRequest


@dataclass
class TokenItem:
    """New tokens of one request; with ``error`` set it is the request's last item, has no
    tokens and ``finish_reason == "error"``. No tokens and no finish_reason: it answers a
    StreamCheck (``position`` is then where the choice's next token goes)."""

    bus_id: str = ident()
    token_ids: list[int] = tokens()
    finish_reason: str | None = text(max_len=16, choices=FINISH_REASONS, default=None)
    error: str | None = text(default=None)
    error_code: str | None = text(max_len=32, default=None)  # see ERROR_CODES
    # on the first item of a request the decode worker prefilled itself: prompt tokens its
    # prefix cache served (None otherwise: a prefill worker already reported them)
    cached_tokens: int | None = count(hi=MAX_TOKENS, default=None)
    index: int = count(hi=MAX_N - 1, default=0)  # the choice (sampling.n > 1) these belong to
    logprobs: TokenLogprobs | None = bounded(default=None)  # of token_ids, when logprobs were asked
    # with the first item of a request prefilled here, when prompt_logprobs were asked
    prompt_logprobs: TokenLogprobs | None = bounded(default=None)
    # index of token_ids[0] in the choice's output (output_token_ids included): a receiver
    # sees lost items as a gap (gateway/inflight/stream_check.py)
    position: int = count(hi=MAX_TOKENS, default=0)


@dataclass
class TokenBatch:
    """Everything one engine step produced for one gateway inbox."""

    TYPE: ClassVar[str] = "token_batch"
    items: list[TokenItem] = bounded(max_len=MAX_BATCH_ITEMS)


@dataclass
class StreamCheck:
    """Where does the stream of ``bus_id`` stand? The worker sends ``reply_to`` its recent
    token batches again, then a TokenItem without tokens per choice, or an "unknown" error."""

    TYPE: ClassVar[str] = "stream_check"
    bus_id: str = ident()
    reply_to: str = subject()


@dataclass
class ReleaseLease:
    TYPE: ClassVar[str] = "release_lease"
    bus_id: str = ident()


@dataclass
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    bus_id: str = ident()
    # one choice of a request with sampling.n > 1 (a stop string ended it); None: all of it
    index: int | None = count(hi=MAX_N - 1, default=None)


@dataclass
class WorkerLoad:
    TYPE: ClassVar[str] = "worker_load"
    worker_id: str = ident()
    role: str = text(max_len=16, choices=ROLES)
    model: str = text(max_len=256)
    free_blocks: int = count()
    total_blocks: int = count()
    running: int = count()
    waiting: int = count()
    draining: bool = bounded(default=False)
    ucx_address: str = text(max_len=MAX_UCX_ADDRESS_CHARS, default="")  # prefill: KV server
    metrics_url: str | None = text(max_len=512, default=None)
    ts: float = seconds(default=0.0)
    # decode workers prefill prompts shorter than this themselves: the gateway then skips the
    # prefill hop and sends DecodeRequest(kv=None)
    local_prefill_threshold: int = count(hi=MAX_TOKENS, default=0)
    kv_stream: bool = bounded(default=False)  # a decode worker that pulls KV layer by layer
    block_size: int = count(hi=1 << 16, default=0)
    # prefill workers: highest lease count they accept; 0 = unknown
    max_queue: int = count(default=0)
    # random per process start: a worker restarted under the same id (compose restarts keep
    # hostname and often pid) is a new incarnation, and whatever the old one held is gone
    instance: str = text(max_len=64, default="")
    # decode workers running speculative decoding: totals since start (the gateway's /metrics
    # re-exports them, so a benchmark against the gateway can report acceptance)
    spec_drafts: int = count(default=0)
    spec_draft_tokens: int = count(default=0)
    spec_accepted_tokens: int = count(default=0)
    # shared.kv_layout.layout_id of the worker's KV fingerprint: the gateway pairs prefill and
    # decode workers whose blocks fit ("": unknown, pairs with anything)
    kv_layout: str = text(max_len=32, default="")
    # roofline (shared/telemetry/roofline.py): forward-pass totals since start per phase (a step
    # with any prefill rows is "prefill"), and the measured peaks of the worker's device (0: none)
    prefill_flops: float = amount()
    prefill_bytes: float = amount()
    prefill_busy_seconds: float = amount()
    decode_flops: float = amount()
    decode_bytes: float = amount()
    decode_busy_seconds: float = amount()
    peak_flops_per_second: float = amount()
    peak_bytes_per_second: float = amount()
    # KV offload tiers: loading one block from host memory / disk, as a fraction of computing
    # it (measured by the worker; 0: not measured, the router's defaults apply)
    kv_host_load_cost: float = amount()
    kv_disk_load_cost: float = amount()
    # services/standby.py: a warm-pool or unverified worker, never routed to until promoted
    standby: bool = bounded(default=False)
    model_version: str = text(max_len=128, default="")  # shown by /v1/models; rollouts use it


@dataclass
class KVEvents:
    """What entered and left one of a worker's KV tiers (``tier``, ``KV_TIERS``), for
    KV-aware routers. Deltas carry the net change since the previous message: ``stored`` hashes
    are in the tier now, ``removed`` ones are not (disjoint lists). Every few seconds a snapshot
    (the whole tier, over ``parts`` messages under one ``seq``) replaces what a gateway knew,
    so a late or lossy one converges. ``seq`` counts messages per worker incarnation.
    A delta's stored blocks may carry their lineage (BlockStored): ``parents[i]`` is the hash
    before ``stored[i]`` in its chain (ROOT_HASH, 0, for a first block), ``token_ids`` their
    tokens back to back; both empty when unknown. ``cleared``: every block of the tier went
    (AllBlocksCleared) before this message's lists apply."""

    TYPE: ClassVar[str] = "kv_events"
    worker_id: str = ident()
    instance: str = text(max_len=64)
    block_size: int = count(lo=1, hi=1 << 16)
    seq: int = count()
    stored: list[int] = bounded(lo=0, hi=UINT64_MAX, max_len=MAX_KV_EVENT_HASHES)
    removed: list[int] = bounded(lo=0, hi=UINT64_MAX, max_len=MAX_KV_EVENT_HASHES)
    snapshot: bool = bounded(default=False)
    part: int = count(hi=1 << 16, default=0)  # snapshots: this message's index among parts
    parts: int = count(lo=1, hi=1 << 16, default=1)
    tier: str = text(max_len=8, choices=KV_TIERS, default="device")
    parents: list[int] = bounded(default=[], lo=0, hi=UINT64_MAX, max_len=MAX_KV_EVENT_HASHES)
    token_ids: list[int] = tokens(max_len=MAX_KV_EVENT_TOKENS, default=[])
    cleared: bool = bounded(default=False)

    def __post_init__(self) -> None:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}")
        if not self.snapshot and self.parts != 1:
            raise ValueError("a delta is one message")
        n = len(self.stored)  # lineage: all of the stored blocks' (none in a snapshot), or none
        if (self.parents or self.token_ids) and (
            self.snapshot or len(self.parents) != n or len(self.token_ids) != n * self.block_size
        ):
            raise ValueError(f"lineage of {len(self.parents)}, {len(self.token_ids)} for {n}")


@dataclass
class WorkerGone:
    """A worker's last word when it leaves cleanly (drain finished): drop it from registries.
    ``rejoining``: not gone - its NATS connection broke and is back; it keeps its requests, but
    what it sent or was sent meanwhile may be lost (gateways check), and peers keep its UCX."""

    TYPE: ClassVar[str] = "worker_gone"
    worker_id: str = ident()
    role: str = text(max_len=16, choices=ROLES)
    rejoining: bool = bounded(default=False)


Message = (
    PrefillRequest
    | PrefillResult
    | DecodeRequest
    | TokenBatch
    | StreamCheck
    | ReleaseLease
    | Cancel
    | WorkerLoad
    | WorkerGone
    | KVEvents
)
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}

_CHECKER = Checker(
    nested=(KVHandle, TokenItem, SamplingParams, GuidedDecoding, TokenLogprobs),
    bounds={
        SamplingParams: SAMPLING_FIELD_BOUNDS,
        GuidedDecoding: GUIDED_FIELD_BOUNDS,
        TokenLogprobs: LOGPROB_FIELD_BOUNDS,
    },
    max_depth=MAX_DEPTH,
    max_text=MAX_TEXT_CHARS,
    max_list=MAX_TOKENS,
)


# ---------------------------------------------------------------------------------------------
# encoding


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def encode(msg: Message) -> bytes:
    body = _to_wire(msg)
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# decoding and checking (shared.wire_check)


def decode(data: bytes, max_bytes: int = 8 * 1024 * 1024) -> Message:
    """Parse and check one bus message. Raises ProtocolError on anything that does not fit."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("message is not bytes")
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {max_bytes} byte limit")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=0,  # we never send binary blobs on the bus
            max_ext_len=0,
            max_array_len=MAX_TOKENS,
            max_map_len=64,
        )
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError(f"not a valid msgpack message: {type(exc).__name__}: {exc}") from None
    if type(body) is not dict:
        raise ProtocolError("message is not a map")
    version = body.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}")
    kind = body.get("type")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(kind)[:40]!r}")
    return _CHECKER.build(cls, body, cls.TYPE, 0, skip=("v", "type"))


def decode_as(data: bytes, *classes: type, max_bytes: int = 8 * 1024 * 1024) -> Any:
    """Decode and insist on one of ``classes`` (each subject carries known message types)."""
    msg = decode(data, max_bytes)
    if not isinstance(msg, classes):
        names = ", ".join(c.TYPE for c in classes)
        raise ProtocolError(f"expected {names}, got {msg.TYPE}")
    return msg
