"""Scripted prefill and decode workers on the in-memory bus, and the gateway's bus side.

A ``FakeWorker`` speaks the real protocol (its messages go through ``Bus.publish`` and the
gateway's checked ``subscribe``) but answers only when a test tells it to: a test awaits the
next request it received, then answers, refuses, streams tokens, restarts or crashes, in
whatever order the scenario needs - no timing, no model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from typing import Any

from pdserve.gateway.dispatch import Dispatcher
from pdserve.gateway.router import Router
from pdserve.shared.bus_memory import MemoryBus, MemoryNetwork
from pdserve.shared.config import BusConfig
from pdserve.shared.protocol import (
    Cancel,
    DecodeRequest,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    ReleaseLease,
    TokenBatch,
    TokenItem,
    WorkerGone,
    WorkerLoad,
    encode,
)
from pdserve.shared.worker_registry import WorkerRegistry

NAMESPACE = "t"
MODEL = "fake-model"
BLOCK_SIZE = 16


async def settle(rounds: int = 10) -> None:
    """Let every queued delivery and its handler run (the memory bus needs no real time)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class FakeWorker:
    def __init__(
        self,
        network: MemoryNetwork,
        role: str,
        worker_id: str,
        *,
        free_blocks: int = 100,
        local_prefill_threshold: int = 0,
        model: str = MODEL,
    ) -> None:
        self.bus = MemoryBus(BusConfig(namespace=NAMESPACE), worker_id, network=network)
        self.load = WorkerLoad(
            worker_id,
            role,
            model,
            free_blocks,
            100,
            0,
            0,
            local_prefill_threshold=local_prefill_threshold,
            block_size=BLOCK_SIZE,
            instance=secrets.token_hex(4),
        )
        self.requests: asyncio.Queue[PrefillRequest | DecodeRequest] = asyncio.Queue()
        self.received: list[PrefillRequest | DecodeRequest] = []
        self.cancels: list[str] = []
        self.released: list[str] = []
        self.headers: list[dict[str, str]] = []

    @property
    def worker_id(self) -> str:
        return self.load.worker_id

    async def start(self) -> FakeWorker:
        await self.bus.connect()
        s = self.bus.subjects
        if self.load.role == "prefill":
            await self.bus.subscribe(s.prefill(self.worker_id), self._on_request, (PrefillRequest,))
            await self.bus.subscribe(s.lease(self.worker_id), self._on_release, (ReleaseLease,))
        else:
            await self.bus.subscribe(s.decode(self.worker_id), self._on_request, (DecodeRequest,))
        await self.bus.subscribe(s.cancel, self._on_cancel, (Cancel,))
        await self.bus.nc.subscribe(s.ping(self.worker_id), cb=self._on_ping)
        await self.beat()
        return self

    # -- what it hears -----------------------------------------------------------------------

    async def _on_request(self, msg, headers: dict[str, str]) -> None:
        self.received.append(msg)
        self.headers.append(headers)
        self.requests.put_nowait(msg)

    async def _on_release(self, msg: ReleaseLease, headers: dict[str, str]) -> None:
        self.released.append(msg.request_id)

    async def _on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        self.cancels.append(msg.request_id)

    async def _on_ping(self, raw: Any) -> None:
        await raw.respond(encode(dataclasses.replace(self.load, ts=time.time())))

    async def next_request(self, timeout: float = 2.0) -> Any:
        return await asyncio.wait_for(self.requests.get(), timeout)

    # -- what it says ------------------------------------------------------------------------

    async def beat(self, **changes: Any) -> None:
        """A heartbeat, with load fields changed first (e.g. ``draining=True``)."""
        self.load = dataclasses.replace(self.load, **changes)
        load = dataclasses.replace(self.load, ts=time.time())
        await self.bus.publish(self.bus.subjects.load(self.load.role, self.worker_id), load)

    async def leave(self) -> None:
        """A clean exit: the registry drops it at once."""
        gone = WorkerGone(self.worker_id, self.load.role)
        await self.bus.publish(self.bus.subjects.load(self.load.role, self.worker_id), gone)

    async def restart(self) -> None:
        """Back under the same id as a new incarnation: the old one's requests are lost."""
        await self.beat(instance=secrets.token_hex(4))

    async def crash(self) -> None:
        """kill -9: no word, no more heartbeats, and nobody answers its pings."""
        await self.bus.nc.crash()

    def kv(self, request: PrefillRequest) -> KVHandle:
        blocks = -(-len(request.prompt_token_ids) // BLOCK_SIZE)
        return KVHandle(
            worker_id=self.worker_id,
            ucx_address="fake-address",
            block_ids=list(range(blocks)),
            num_tokens=len(request.prompt_token_ids),
            fingerprint={"model": MODEL},
            lease_expires=time.time() + 30,
        )

    async def prefilled(
        self, request: PrefillRequest, first_token: int = 7, finish: str | None = None
    ) -> PrefillResult:
        result = PrefillResult(
            request.request_id,
            self.worker_id,
            first_token,
            finish,
            self.kv(request),  # held under a lease even when done at the first token
            None,
            cached_tokens=3,
        )
        await self.bus.publish(request.reply_to, result)
        return result

    async def refuse(self, request: Any, code: str = "overloaded", error: str = "full") -> None:
        if isinstance(request, PrefillRequest):
            msg: Any = PrefillResult.failure(request.request_id, self.worker_id, code, error)
        else:
            item = TokenItem(request.request_id, [], "error", error, code)
            msg = TokenBatch([item])
        await self.bus.publish(request.reply_to, msg)

    async def tokens(
        self, request: DecodeRequest, token_ids: list[int], finish: str | None = None
    ) -> None:
        item = TokenItem(request.request_id, token_ids, finish)
        await self.bus.publish(request.reply_to, TokenBatch([item]))


class GatewaySide:
    """The gateway's bus side without HTTP: bus, worker registry, router, dispatcher."""

    def __init__(
        self,
        network: MemoryNetwork,
        *,
        request_timeout: float = 10.0,
        prefill_timeout: float = 10.0,
        worker_timeout: float = 30.0,
        max_message_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.now = 0.0  # the registry's clock: tests move it to age heartbeats out
        config = BusConfig(namespace=NAMESPACE, max_message_bytes=max_message_bytes)
        self.bus = MemoryBus(config, "gw", network=network)
        self.workers = WorkerRegistry(self.bus, worker_timeout, clock=lambda: self.now)
        self.router = Router(
            self.workers.routable, BLOCK_SIZE, model=MODEL, cached_hits=self.workers.prefix_hits
        )
        self.dispatcher = Dispatcher(
            self.bus, self.workers, self.router, "gw1", request_timeout, prefill_timeout
        )

    async def start(self) -> GatewaySide:
        await self.bus.connect()
        await self.workers.start()
        await self.dispatcher.start()
        return self

    async def stop(self) -> None:
        await self.workers.stop()
        await self.dispatcher.close()
        await self.bus.close()
