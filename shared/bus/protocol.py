"""The wire protocol between gateway and workers: msgpack maps with a version and a type.

Every message is a dataclass, kept with the others of its conversation: ``request_messages``
(prefill, decode, cancel), ``stream_messages`` (token batches, stream checks), ``lease_messages``
(the KV handle, its release) and ``discovery_messages`` (heartbeats, departures, KV events). This
module is the one place that knows them all: the type registry and the checker, ``encode`` and
``decode``. ``encode`` turns a message into bytes; ``decode`` parses bytes from the bus and checks
every field's type and bounds before a message object exists, so code behind it can trust what
it gets. Anything else - an unknown type or version, a missing or extra field, a wrong type, an
oversized string or list, a non-finite float - raises ``ProtocolError``. msgpack never
instantiates objects, and nothing is ever unpickled.

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
from typing import Any

import msgpack

from pdserve.shared.bus.discovery_messages import KVEvents, WorkerGone, WorkerLoad
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.request_messages import (
    Cancel,
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
)
from pdserve.shared.bus.stream_messages import StreamCheck, TokenBatch, TokenItem
from pdserve.shared.bus.wire_check import Checker, ProtocolError
from pdserve.shared.bus.wire_fields import (
    GUIDED_FIELD_BOUNDS,
    LOGPROB_FIELD_BOUNDS,
    MAX_DEPTH,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    SAMPLING_FIELD_BOUNDS,
)
from pdserve.shared.sampling import GuidedDecoding, SamplingParams, TokenLogprobs

PROTOCOL_VERSION = 15  # 3: n choices, log-probs, penalties, structured output; 4: positions;
# 5: one name per id (bus_id on the bus, client_id for the x-request-id); 6: TP ranks' KV servers
# 7: WorkerLoad's roofline totals and peaks; 8: KVEvents per KV tier, WorkerLoad's tier load costs
# 9: KV events' parents, token ids and clears; WorkerLoad's standby state and model version;
# 10: layer-wise KV streaming (PrefillRequest.stream_kv, KVHandle.streaming, kv_stream)
# 11: KVHandle.epoch, the lease's block generation (KV wire version 4)
# 12: SamplingParams.priority and cache_salt (tenants' scheduling and prefix-cache isolation)
# 13: GuidedDecoding.reasoning (structured output after a reasoning model's thoughts)
# 14: multi-LoRA: Prefill/DecodeRequest.lora, WorkerLoad.lora_adapters and KV handles' lora
# 15: KV events name the adapter of blocks computed under one (KVEvents.lora_names, lora_index)

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
# the message types by wire name; shared/kv/probe.py and shared/discovery/cache_reset.py add
# their request/reply types (spoken by fewer processes) when they are imported
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


def _unpack(data: bytes | bytearray | memoryview, max_bytes: int) -> Any:
    """msgpack bytes to Python values, every size bounded before memory is spent on it.

    The byte limit bounds strings and the number of values, but not their cost: one byte
    (``0x80``, an empty map) becomes a 64-byte dict, so 8 MiB of them would take half a GiB.
    ``_ContainerBudget`` stops the unpacker past ``MAX_CONTAINERS`` maps and arrays. Nesting
    past msgpack's own stack (1024 levels) fails in the unpacker; the checker refuses anything
    deeper than ``MAX_DEPTH`` after it."""
    budget = _ContainerBudget()
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_str_len=max_bytes,
        max_bin_len=0,  # we never send binary blobs on the bus
        max_ext_len=0,
        max_array_len=MAX_TOKENS,
        max_map_len=64,
        object_hook=budget.map,
        list_hook=budget.array,
    )


# Maps and arrays in one message. The largest honest message, a TokenBatch of MAX_BATCH_ITEMS
# items each with log-probs for its tokens and its prompt, holds about 12 per item (~50k).
MAX_CONTAINERS = 1 << 17


class _ContainerBudget:
    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def map(self, value: dict) -> dict:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"more than {MAX_CONTAINERS} maps and arrays", "malformed")
        return value

    def array(self, value: list) -> list:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"more than {MAX_CONTAINERS} maps and arrays", "malformed")
        return value


def decode(data: bytes, max_bytes: int = 8 * 1024 * 1024) -> Message:
    """Parse and check one bus message. Raises ProtocolError on anything that does not fit;
    its ``reason`` says which check failed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("message is not bytes", "malformed")
    if len(data) > max_bytes:
        raise ProtocolError(
            f"message of {len(data)} bytes exceeds the {max_bytes} byte limit", "too_large"
        )
    try:
        body = _unpack(data, max_bytes)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError(
            f"not a valid msgpack message: {type(exc).__name__}: {exc}"[:200], "malformed"
        ) from None
    if type(body) is not dict:
        raise ProtocolError("message is not a map", "malformed")
    version = body.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {str(version)[:20]!r}", "version")
    kind = body.get("type")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(kind)[:40]!r}", "unknown_type")
    return _CHECKER.build(cls, body, cls.TYPE, 0, skip=("v", "type"))


def decode_as(data: bytes, *classes: type, max_bytes: int = 8 * 1024 * 1024) -> Any:
    """Decode and insist on one of ``classes`` (each subject carries known message types)."""
    msg = decode(data, max_bytes)
    if not isinstance(msg, classes):
        names = ", ".join(c.TYPE for c in classes)
        raise ProtocolError(f"expected {names}, got {msg.TYPE}", "unexpected_type")
    return msg
