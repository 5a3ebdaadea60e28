"""Scripted prefill and decode workers on the in-memory bus, and the gateway's bus side.

A ``FakeWorker`` speaks the real protocol (its messages go through ``Bus.publish`` and the
gateway's checked ``subscribe``) but answers only when a test tells it to: a test awaits the
next request it received, then answers, refuses, streams tokens, restarts or crashes, in
whatever order the scenario needs - no timing, no model. Its token items carry their positions
as a decode worker's do; a test may lose some on the way (``lose``) to make a gap, and have the
worker send them again when a gateway checks the stream (``answer(check, replay=True)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from typing import Any

from pdserve.gateway.inflight.dispatcher import Dispatcher
from pdserve.gateway.router import Router
from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.protocol import encode
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import StreamCheck, TokenBatch, TokenItem
from pdserve.shared.config import BusConfig
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from tests.bus_memory import MemoryBus, MemoryNetwork

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
        self.checks: asyncio.Queue[StreamCheck] = asyncio.Queue()
        # (bus id, choice) -> position of its next token, as a decode worker keeps them
        self.positions: dict[tuple[str, int], int] = {}
        self.history: dict[str, list[TokenItem]] = {}  # bus id -> every item sent (or lost)

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
            await self.bus.subscribe(
                s.decode(self.worker_id), self._on_request, (DecodeRequest, StreamCheck)
            )
        await self.bus.subscribe(s.cancel, self._on_cancel, (Cancel,))
        await self.bus.nc.subscribe(s.ping(self.worker_id), cb=self._on_ping)
        await self.beat()
        return self

    # -- what it hears -----------------------------------------------------------------------

    async def _on_request(self, msg, headers: dict[str, str]) -> None:
        if isinstance(msg, StreamCheck):
            self.checks.put_nowait(msg)
            return
        if isinstance(msg, DecodeRequest):
            self.positions[msg.bus_id, 0] = len(msg.output_token_ids)
        self.received.append(msg)
        self.headers.append(headers)
        self.requests.put_nowait(msg)

    async def _on_release(self, msg: ReleaseLease, headers: dict[str, str]) -> None:
        self.released.append(msg.bus_id)

    async def _on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        self.cancels.append(msg.bus_id)

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

    async def reconnected(self) -> None:
        """Its NATS connection broke and is back: it says so, keeps its requests, and beats."""
        back = WorkerGone(self.worker_id, self.load.role, rejoining=True)
        await self.bus.publish(self.bus.subjects.load(self.load.role, self.worker_id), back)
        await self.beat()

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
            request.bus_id,
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
            msg: Any = PrefillResult.failure(request.bus_id, self.worker_id, code, error)
        else:
            item = TokenItem(request.bus_id, [], "error", error, code)
            msg = TokenBatch([item])
        await self.bus.publish(request.reply_to, msg)

    def item(
        self, request: DecodeRequest, token_ids: list[int], finish: str | None = None, index=0
    ) -> TokenItem:
        """The next item of choice ``index`` of ``request``'s stream, at its position."""
        key = (request.bus_id, index)
        position = self.positions.get(key, 0)
        self.positions[key] = position + len(token_ids)
        item = TokenItem(request.bus_id, token_ids, finish, index=index, position=position)
        self.history.setdefault(request.bus_id, []).append(item)
        return item

    async def tokens(
        self, request: DecodeRequest, token_ids: list[int], finish: str | None = None, index=0
    ) -> None:
        item = self.item(request, token_ids, finish, index)
        await self.bus.publish(request.reply_to, TokenBatch([item]))

    def lose(self, request: DecodeRequest, token_ids: list[int], finish=None, index=0) -> None:
        """An item the bus loses on the way: it counts for the stream's positions only."""
        self.item(request, token_ids, finish, index)

    async def next_check(self, timeout: float = 2.0) -> StreamCheck:
        return await asyncio.wait_for(self.checks.get(), timeout)

    async def answer(self, check: StreamCheck, *, replay: bool = False, forgot: bool = False):
        """Answer ``check`` as a decode worker does: with ``replay``, every item of the stream
        again first (a worker replays what it sent lately); then where each choice stands, or
        "unknown" (``forgot``: the request is over here, or never arrived)."""
        rid = check.bus_id
        if replay:
            await self.bus.publish(check.reply_to, TokenBatch(self.history.get(rid, [])))
        if forgot:
            items = [TokenItem(rid, [], "error", "no such request", "unknown")]
        else:
            known = sorted((i, p) for (r, i), p in self.positions.items() if r == rid)
            items = [TokenItem(rid, [], index=i, position=p) for i, p in known]
        await self.bus.publish(check.reply_to, TokenBatch(items))

    async def trickle(
        self, request: DecodeRequest, token_ids: list[int], every: float, finish: str = "length"
    ) -> None:
        """A slow but live worker: one token every ``every`` seconds, the last with ``finish``."""
        for i, token in enumerate(token_ids):
            await asyncio.sleep(every)
            await self.tokens(request, [token], finish if i == len(token_ids) - 1 else None)


class GatewaySide:
    """The gateway's bus side without HTTP: bus, worker registry, router, dispatcher."""

    def __init__(
        self,
        network: MemoryNetwork,
        *,
        request_timeout: float = 10.0,
        prefill_timeout: float = 10.0,
        first_token_timeout: float = 10.0,
        stall_timeout: float = 10.0,
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
            self.bus,
            self.workers,
            self.router,
            "gw1",
            request_timeout,
            prefill_timeout,
            first_token_timeout=first_token_timeout,
            stall_timeout=stall_timeout,
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
