"""A worker's KV event streams (issue 33): what its KV tiers hold, for KV-aware routers.

``KVEvents`` on NATS (``{ns}.kv.{worker}``, read by pdserve's gateways) and, with
``--kv-events-zmq ENDPOINT``, the same deltas in vLLM's KV-event format on a ZMQ PUB socket
(``shared/discovery/vllm_kv_events.py``: llm-d, Dynamo). Both are fed from the engine's
``KVEventFeed`` on the worker's event loop; the ZMQ stream is a listener of the NATS one, so
the two always tell the same story.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from pdserve.services.engine.kv_event_feed import KVEventFeed
from pdserve.shared.bus.connection import Bus
from pdserve.shared.config import WorkerConfig
from pdserve.shared.discovery.kv_publisher import KVEventPublisher
from pdserve.shared.discovery.vllm_kv_events import ZmqKVEventPublisher


class Worker(Protocol):
    """What the streams take from ``services.worker_base.Worker``."""

    bus: Bus
    config: WorkerConfig
    worker_id: str
    instance: str
    engine: Any  # an LLMEngine: its block_size


class KVEventStreams:
    def __init__(self, nats: KVEventPublisher, zmq: ZmqKVEventPublisher | None) -> None:
        self.nats = nats
        self.zmq = zmq

    async def start(self) -> None:
        await self.nats.start()

    async def stop(self) -> None:
        await self.nats.stop()
        if self.zmq is not None:
            with contextlib.suppress(Exception):
                self.zmq.close()


def kv_event_streams(worker: Worker, feed: KVEventFeed) -> KVEventStreams:
    """The streams of ``worker``'s KV tiers, from its engine's ``feed`` (not started)."""
    cfg = worker.config
    zmq = None
    if cfg.kv_events_zmq:
        zmq = ZmqKVEventPublisher(
            cfg.kv_events_zmq, cfg.kv_events_zmq_topic, cfg.kv_events_zmq_format
        )
    nats = KVEventPublisher(
        worker.bus,
        worker.worker_id,
        worker.instance,
        worker.engine.block_size,
        feed.drain_delta,
        feed.snapshot,
        cfg.heartbeat_seconds,
        tiers=feed.tiers,
        listeners=(zmq,) if zmq is not None else (),
    )
    return KVEventStreams(nats, zmq)
