"""A worker's KV events in vLLM's KV-event format over ZMQ (``--kv-events-zmq ENDPOINT``), so
llm-d's KV-cache manager, Dynamo's router or anything else that reads vLLM's stream can follow
which worker holds which prefix, unmodified.

The definition followed: ``vllm/distributed/kv_events.py`` of vllm-project/vllm at commit
0181ea3173e53eea8cf04a86891488e3dc89bb34 (after vLLM PR #42892), and the same file before
#42892 (vLLM <= 0.23, ``--kv-events-zmq-format array``):

* Framing (``ZmqEventPublisher``): a PUB socket; each batch is one multipart message
  ``[topic, seq, payload]``: ``topic`` the configured topic's UTF-8 bytes ("" by default),
  ``seq`` an 8-byte big-endian counter from 0, ``payload`` msgpack of a ``KVEventBatch``. The
  endpoint is bound when it holds ``*`` or ``::`` or is ``ipc://``/``inproc://``, else
  connected (vLLM's rule). vLLM's optional replay ROUTER socket is not offered: a subscriber
  sees a lost batch as a gap in ``seq`` (a batch dropped here leaves one too).
* ``KVEventBatch`` (msgspec ``array_like=True``, ``omit_defaults=True``):
  ``[ts: float, events: list, data_parallel_rank: int]``; the rank is 0 (one engine).
* Events (msgspec ``tag=True``: the tag is the class name), with ``omit_defaults=True``:
  ``BlockStored(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
  block_size: int, lora_id: int | None, medium: str | None, lora_name: str | None,
  extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
  kv_cache_spec_sliding_window=None)``, ``BlockRemoved(block_hashes: list[int], medium: str |
  None, group_idx=None)``, ``AllBlocksCleared()``. Fields equal to their default are left out.
  * ``map`` (the default, vLLM since #42892): each event is a map, the tag under ``"type"``:
    ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
    [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}``.
  * ``array`` (vLLM <= 0.23, ``array_like=True``): a tagged array,
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

The mapping from pdserve (docs/kv-events.md): a tier's blocks carry vLLM's ``medium`` (``MEDIUM``:
device pool "GPU" - also on a CPU-only worker, it is the engine's own pool -, host memory "CPU",
disk "DISK"); block hashes are pdserve's chained 64-bit blake2b hashes as unsigned integers (vLLM's
default ``ExternalBlockHash`` is also a 64-bit integer, but computed differently: a consumer that
recomputes hashes from tokens must use pdserve's); a prompt's first block has ``parent_block_hash``
None; consecutive blocks of one chain go in one BlockStored, as vLLM sends them. A block computed
under a LoRA adapter names it in ``lora_name`` (its chain's first hash has the adapter in its
``extra_keys``); ``lora_id`` stays None: vLLM's is a number its process gave the adapter, pdserve's
workers know adapters by name only. A clear of any tier is AllBlocksCleared (vLLM's has no medium);
a worker's first batch is one, so a consumer forgets what an earlier process on the endpoint held.
Blocks whose tokens the worker does not know (disk blocks indexed at start) are not announced:
``skipped_blocks`` counts them.

Never in the way of a step: the conversion runs on the worker's event loop (the NATS
publisher's listener), batches wait in a bounded queue (the oldest dropped, ``dropped``
counts), and a thread of their own packs and sends them with NOBLOCK (``send_failed`` counts
what ZMQ refused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgpack

from pdserve.shared.bus.discovery_messages import KVEvents
from pdserve.shared.kv.layout import ROOT_HASH  # the parent of a prompt's first block

log = logging.getLogger(__name__)

MEDIUM = {"device": "GPU", "host": "CPU", "disk": "DISK"}
FORMATS = ("map", "array")
MAX_QUEUE = 1024  # batches waiting for the sender thread
_FIELDS = {  # each event's fields in declaration order (the array form's positions)
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

Event = dict[str, Any]  # {"type": tag, field: value...} in declaration order


def stored_events(msg: KVEvents) -> list[Event]:
    """BlockStored events for a message's stored blocks, one per run of consecutive blocks of
    one chain (none without lineage)."""
    out: list[Event] = []
    bs, medium = msg.block_size, MEDIUM[msg.tier]
    loras = [None, *msg.lora_names]
    index = msg.lora_index or [0] * len(msg.stored)
    start = 0
    for i in range(1, len(msg.stored) + 1):
        if i < len(msg.stored) and msg.parents[i] == msg.stored[i - 1] and index[i] == index[i - 1]:
            continue  # the chain goes on (under one adapter: a chain never changes it)
        parent = msg.parents[start]
        out.append(
            {
                "type": "BlockStored",
                "block_hashes": msg.stored[start:i],
                "parent_block_hash": None if parent == ROOT_HASH else parent,
                "token_ids": msg.token_ids[start * bs : i * bs],
                "block_size": bs,
                "lora_id": None,
                "medium": medium,
                "lora_name": loras[index[start]],
            }
        )
        start = i
    return out


def to_vllm_events(msg: KVEvents) -> list[Event]:
    """One ``KVEvents`` delta as vLLM events: its clear, its removals, its stores."""
    out: list[Event] = [{"type": "AllBlocksCleared"}] if msg.cleared else []
    if msg.removed:
        out.append(
            {"type": "BlockRemoved", "block_hashes": msg.removed, "medium": MEDIUM[msg.tier]}
        )
    if msg.parents:
        out += stored_events(msg)
    return out


def encode_event(event: Event, fmt: str) -> Any:
    if fmt == "map":
        return event
    tag = event["type"]
    return [tag, *(event[name] for name in _FIELDS[tag])]


def encode_batch(ts: float, events: list[Event], fmt: str) -> bytes:
    """The msgpack payload of one ``KVEventBatch``."""
    body = [ts, [encode_event(e, fmt) for e in events], 0]
    return msgpack.packb(body, use_bin_type=True)


class DropOldest:
    """The batches waiting for the sender thread: bounded, the oldest dropped when full (a
    consumer sees the gap in ``seq``), and a wait that sleeps until there is something."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.dropped = 0
        self.closed = False
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()

    def put(self, item: Any) -> None:
        with self._cond:
            if len(self._items) >= self.max_len:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)
            self._cond.notify()

    def take_all(self, wait: bool = True) -> list[Any] | None:
        """Everything queued, oldest first; None once closed and empty."""
        with self._cond:
            while wait and not self._items and not self.closed:
                self._cond.wait()
            if not self._items:
                return None if self.closed else []
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()


class ZmqKVEventPublisher:
    """A ``KVEventPublisher`` listener that republishes its deltas in vLLM's format."""

    def __init__(
        self, endpoint: str, topic: str = "", fmt: str = "map", max_queue: int = MAX_QUEUE
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"KV event format {fmt!r}: one of {FORMATS}")
        import zmq  # only workers that publish on ZMQ load it

        self.endpoint, self.fmt = endpoint, fmt
        self.topic = topic.encode()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self.queue = DropOldest(max_queue)  # (seq, ts, events) per batch
        self._first = True
        self.seq = 0  # given at enqueue: a batch dropped here is a gap a subscriber sees
        self.sent = self.send_failed = self.skipped_blocks = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # a bad endpoint fails the worker's start, loudly
            raise self._error

    def __call__(self, msgs: list[KVEvents]) -> None:
        """The deltas among ``msgs`` as one batch (snapshots have no vLLM counterpart: a
        consumer builds its picture from the stream, as from vLLM's)."""
        events: list[Event] = []
        if self._first:
            self._first = False
            events.append({"type": "AllBlocksCleared"})
        for msg in msgs:
            if msg.snapshot:
                continue
            if msg.stored and not msg.parents:
                self.skipped_blocks += len(msg.stored)
            events += to_vllm_events(msg)
        if events:
            self.put(events)

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    def put(self, events: list[Event]) -> None:
        self.queue.put((self.seq, time.time(), events))
        self.seq += 1

    def _run(self) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 500)  # close: what is queued may still go out, briefly
        try:
            e = self.endpoint
            bind = "*" in e or "::" in e or e.startswith(("ipc://", "inproc://"))
            sock.bind(e) if bind else sock.connect(e)
        except Exception as exc:
            self._error = exc
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            while (batches := self.queue.take_all()) is not None:
                for seq, ts, events in batches:
                    self._send(sock, seq, encode_batch(ts, events, self.fmt))
        finally:
            sock.close()

    def _send(self, sock: Any, seq: int, payload: bytes) -> None:
        try:
            sock.send_multipart(
                [self.topic, seq.to_bytes(8, "big"), payload], flags=self._zmq.NOBLOCK
            )
            self.sent += 1
        except self._zmq.Again:  # the high-water mark: a slow subscriber loses, we never wait
            self.send_failed += 1

    def close(self) -> None:
        """Send what waits, then stop the thread and the socket."""
        self.queue.close()
        self._thread.join(timeout=5.0)
        self._ctx.term()
        if self.dropped or self.send_failed:
            log.warning(
                "vLLM KV events: %d batches dropped (queue full), %d refused by ZMQ",
                self.dropped,
                self.send_failed,
            )
