"""The gateway's side of the worker protocol, minus HTTP, for tests that drive real prefill and
decode workers over a real nats-server (tests/integration/test_workers.py and others)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import replace

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.request_messages import DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.config import BusConfig
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from pdserve.shared.sampling import SamplingParams
from tests.integration.stack import Child, log_text

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class TestGateway:
    """The gateway's half of the protocol, minus HTTP: inbox, requests, registry."""

    __test__ = False

    def __init__(self, nats_url: str) -> None:
        self.bus = Bus(BusConfig(nats_url=nats_url), "test-gateway")
        self.inbox = self.bus.subjects.gateway("tg")
        self.registry = WorkerRegistry(self.bus, timeout=2.0)
        self.queues: dict[str, asyncio.Queue] = {}
        self.batches: list[TokenBatch] = []

    async def start(self) -> None:
        await self.bus.connect()
        await self.bus.subscribe(self.inbox, self._on_message, (PrefillResult, TokenBatch))
        await self.registry.start()

    async def _on_message(self, msg, headers) -> None:
        if isinstance(msg, PrefillResult):
            self.queue(msg.bus_id).put_nowait(msg)
            return
        self.batches.append(msg)
        for item in msg.items:
            self.queue(item.bus_id).put_nowait(item)

    def queue(self, rid: str) -> asyncio.Queue:
        return self.queues.setdefault(rid, asyncio.Queue())

    async def prefill(
        self,
        worker: str,
        rid: str,
        prompt: list[int],
        sp: SamplingParams = GREEDY,
        headers: dict[str, str] | None = None,
        **kw,
    ) -> PrefillResult:
        req = PrefillRequest(rid, prompt, sp, self.inbox, time.time() + 30)
        await self.bus.publish(self.bus.subjects.prefill(worker), replace(req, **kw), headers)
        return await asyncio.wait_for(self.queue(rid).get(), 20)

    async def send_decode(
        self, worker: str, rid: str, prompt: list[int], output: list[int], kv, **kw
    ) -> None:
        sp = kw.pop("sampling", GREEDY)
        headers = kw.pop("headers", None)
        req = DecodeRequest(rid, prompt, output, sp, kv, self.inbox, time.time() + 30)
        await self.bus.publish(self.bus.subjects.decode(worker), replace(req, **kw), headers)

    async def items(self, rid: str, timeout: float = 20) -> list[TokenItem]:
        """Every item of one request up to and including the one with a finish reason."""
        out: list[TokenItem] = []
        while not out or out[-1].finish_reason is None:
            out.append(await asyncio.wait_for(self.queue(rid).get(), timeout))
        return out

    async def decode(self, worker: str, rid: str, prompt, output, kv, **kw) -> list[TokenItem]:
        await self.send_decode(worker, rid, prompt, output, kv, **kw)
        return await self.items(rid)

    def load(self, worker: str) -> WorkerLoad | None:
        return self.registry.get(worker)

    async def until_idle(self, *workers: str, timeout: float = 5.0) -> None:
        """Every block of ``workers`` back on the free list, per heartbeats sent after this call
        (an older heartbeat may predate the work being waited for)."""
        since = time.time()

        def idle(w: str) -> bool:
            load = self.load(w)
            return (
                load is not None
                and load.ts >= since
                and load.free_blocks == load.total_blocks
                and not load.running
            )

        deadline = time.monotonic() + timeout
        while not all(idle(w) for w in workers):
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks not freed: {[self.load(w) for w in workers]}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.registry.stop()
        await self.bus.close()


def tokens(items: list[TokenItem]) -> list[int]:
    return [t for item in items for t in item.token_ids]


@asynccontextmanager
async def connected(nats_url: str, children: Iterable[Child]) -> AsyncIterator[TestGateway]:
    """A TestGateway once every child has sent a heartbeat; fails naming a child that died."""
    children = list(children)
    gateway = TestGateway(nats_url)
    await gateway.start()
    try:
        deadline = time.monotonic() + 120
        while not all(gateway.load(c.name) for c in children):
            for child in children:
                assert child.alive(), f"{child.name} died:\n{log_text(child)}"
            assert time.monotonic() < deadline, "workers did not come up"
            await asyncio.sleep(0.1)
        yield gateway
    finally:
        await gateway.close()
