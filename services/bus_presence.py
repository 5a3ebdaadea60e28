"""A worker as the bus sees it, beyond the requests its role subscribes to.

Every worker beats (``WorkerLoad`` heartbeats, answering pings), streams what its KV tiers hold
(``kv_event_streams.py``), shows up in NATS tooling (``nats.micro``), answers the gateway's admin
subjects (``POST /reset_prefix_cache``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)
and the cancel broadcast, and after a NATS reconnect says
that messages may have been lost. All of it starts once the role has subscribed and stops when
the worker leaves (``WorkerGone``); the role itself takes part only through its cancel hooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.kv_event_feed import KVEventFeed
from pdserve.services.engine.lora.slots import AdapterNameTaken
from pdserve.services.kv_event_streams import KVEventStreams, kv_event_streams
from pdserve.services.recent_cancels import RecentCancels
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.bus.request_messages import Cancel
from pdserve.shared.bus.subjects import Subjects
from pdserve.shared.config import WorkerConfig
from pdserve.shared.discovery.announce import HeartbeatPublisher, register_micro_service
from pdserve.shared.discovery.cache_reset import answer_resets
from pdserve.shared.discovery.lora_admin import LoraCommand, UnloadLoraAdapter, answer_lora_commands
from pdserve.shared.errors import ModelLoadError

log = logging.getLogger(__name__)


class PresentWorker(Protocol):
    """What the presence needs of ``services.worker_base.Worker``."""

    bus: Bus
    subjects: Subjects
    config: WorkerConfig
    worker_id: str
    role: str
    instance: str
    engine: LLMEngine | None
    recent_cancels: RecentCancels

    async def on_cancel(self, bus_id: str) -> None: ...

    async def on_cancel_choice(self, bus_id: str, index: int) -> None: ...


class BusPresence:
    def __init__(self, worker: PresentWorker, load: Callable[[], WorkerLoad]) -> None:
        self.worker = worker
        self.load = load  # each heartbeat's content
        self._heartbeat: HeartbeatPublisher | None = None
        self._kv_events: KVEventStreams | None = None
        self._micro: Any = None  # the NATS micro service (nats.micro's Service), if registered

    async def start(self, feed: KVEventFeed | None) -> None:
        """Answer resets and cancels, beat, stream the KV events from ``feed`` (None: no prefix
        cache), register with NATS tooling."""
        worker, bus = self.worker, self.worker.bus
        await answer_resets(bus, worker.worker_id, self._reset_prefix_cache)
        await answer_lora_commands(bus, worker.worker_id, self._lora_command)
        await bus.subscribe(worker.subjects.cancel, self._on_cancel, (Cancel,))
        self._heartbeat = HeartbeatPublisher(bus, self.load, worker.config.heartbeat_seconds)
        await self._heartbeat.start()
        bus.on_reconnect(self._on_reconnect)
        if feed is not None:
            # what its KV tiers hold, for KV-aware routers: ours (NATS), vLLM's format (ZMQ)
            self._kv_events = kv_event_streams(worker, feed)
            await self._kv_events.start()
        with contextlib.suppress(Exception):  # optional: visibility for NATS tooling
            self._micro = await register_micro_service(bus, self.load)

    async def publish_load(self) -> None:
        """A heartbeat now, not at the next beat: a drain, a promotion, a reconnect."""
        if self._heartbeat is not None:
            await self._heartbeat.publish_now()

    async def stop(self) -> None:
        """Leave: the KV event streams end, the last heartbeat says ``WorkerGone``."""
        if self._kv_events is not None:
            await self._kv_events.stop()
        if self._heartbeat is not None:
            await self._heartbeat.stop(gone=True)
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()

    async def _on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        worker = self.worker
        if msg.index is not None:
            await worker.on_cancel_choice(msg.bus_id, msg.index)
            return
        # it may have overtaken the request it cancels: that one is dropped when it arrives
        worker.recent_cancels.add(msg.bus_id)
        await worker.on_cancel(msg.bus_id)

    async def _reset_prefix_cache(self, external: bool) -> tuple[int, int] | None:
        """``POST /reset_prefix_cache``: the cached blocks forgotten, the pool's and (external)
        the tiers' (None: busy)."""
        engine = self.worker.engine
        assert engine is not None, "resets are answered once the engine runs"
        return await asyncio.wrap_future(engine.reset_prefix_cache(external))

    async def _lora_command(self, cmd: LoraCommand) -> tuple[str, str]:
        """Load or unload an adapter on the engine's thread (it owns the slots); the status
        and reason of ``shared/discovery/lora_admin.py``. A change is heartbeaten at once, so
        that gateways route by it without waiting for the next beat."""
        engine = self.worker.engine
        assert engine is not None, "adapters are loaded once the engine runs"
        unload = isinstance(cmd, UnloadLoraAdapter)
        future = engine.unload_lora(cmd.name) if unload else engine.load_lora(cmd.name, cmd.path)
        try:
            done = await asyncio.wrap_future(future)
        except KeyError:
            return "unknown", f"no LoRA adapter {cmd.name!r} on this worker"
        except ValueError as exc:
            return "disabled", str(exc)
        except AdapterNameTaken as exc:
            return "exists", str(exc)
        except (ModelLoadError, OSError) as exc:
            return "invalid", str(exc)
        await self.publish_load()
        return ("ok" if done is not False else "deferred"), ""

    async def _on_reconnect(self) -> None:
        """Our NATS node went away (a node died, a restart): what we published into the dead
        connection, and what was sent to us while unsubscribed, may be lost. Say so
        (``WorkerGone(rejoining=True)``; we keep our requests): gateways retry their prefills
        here, check their streams (``gateway/inflight/stream_check.py``: those that lost tokens migrate, the
        others go on) and cancel again what they abandoned."""
        worker = self.worker
        log.warning("reconnected to NATS: telling gateways that messages may be lost")
        subject = worker.subjects.load(worker.role, worker.worker_id)
        gone = WorkerGone(worker_id=worker.worker_id, role=worker.role, rejoining=True)
        await worker.bus.publish(subject, gone)
        await self.publish_load()
