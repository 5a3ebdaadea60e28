"""A fault-test stack for tests/integration/test_migration.py: real NATS, one prefill and three
decode workers, two gateways (default --max-migrations, and --max-migrations 1), plus what the
tests need around it: killing and reviving workers, a bus spy that sees every DecodeRequest,
streams read chunk by chunk with their arrival times, and the gateway's metrics."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nats
from prometheus_client.parser import text_string_to_metric_families

from pdserve.shared.bus.protocol import decode
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from tests.integration.stack import Child, free_port, log_text, start_service

WORKER_OPTIONS = {
    "dtype": "float64",  # greedy ties and sampled draws cannot flip between batch shapes
    "block_size": 16,
    "max_num_batched_tokens": 1024,
    "heartbeat_seconds": 0.2,
    "local_prefill_threshold": 6,
    "kv_failure_policy": "recompute",
    "num_kv_blocks": 256,
}
# d2 fails a request whose KV pull fails (the policy "fail"), and has the most KV blocks: an
# idle stack routes a request there, a request arriving while d2 has one goes to d0 or d1.
WORKERS: dict[str, tuple[str, dict]] = {
    "p0": ("prefill", {}),
    "d0": ("decode", {}),
    "d1": ("decode", {}),
    "d2": ("decode", {"kv_failure_policy": "fail", "num_kv_blocks": 384}),
}
GATEWAY_OPTIONS = {"worker_timeout": 1.5, "request_timeout": 180.0}


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    logprobs: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[int, str] = field(default_factory=dict)
    error: dict | None = None
    done: bool = False
    times: list[float] = field(default_factory=list)  # arrival of each chunk with text

    def tokens_seen(self) -> int:
        return len(self.times)

    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0)


class Stack:
    def __init__(self, nats_url: str, logs: Path, model_dir: Path) -> None:
        self.nats_url = nats_url
        self.logs = logs
        self.model_dir = model_dir
        self.children: dict[str, Child] = {}
        self.bases: dict[str, str] = {}

    def start_worker(self, name: str) -> None:
        role, extra = WORKERS[name]
        options = {**WORKER_OPTIONS, **extra, "model": str(self.model_dir), "worker_id": name}
        self.children[name] = start_service(role, self.nats_url, self.logs, options=options)

    def start_gateway(self, name: str, **options: object) -> None:
        port = free_port()
        options = {**GATEWAY_OPTIONS, **options, "model": str(self.model_dir), "port": port}
        self.children[name] = start_service(
            "gateway", self.nats_url, self.logs, options=options, name=name
        )
        self.bases[name] = f"http://127.0.0.1:{port}"

    def base(self, gateway: str = "gw") -> str:
        return self.bases[gateway]

    def live_workers(self) -> set[str]:
        return {n for n in WORKERS if n in self.children and self.children[n].alive()}

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Every live worker is known to every gateway."""
        deadline = time.monotonic() + timeout
        want = self.live_workers()
        while any(set(worker_blocks(b)) != want for b in self.bases.values()):
            for child in self.children.values():
                assert child.alive() or child.name in WORKERS, f"{child.name} died"
            assert time.monotonic() < deadline, f"the stack did not come up:\n{self.logs_tail()}"
            time.sleep(0.2)

    def revive(self) -> None:
        """Start again (same id, a new incarnation) every worker a test killed."""
        dead = [n for n in WORKERS if not self.children[n].alive()]
        for name in dead:
            self.start_worker(name)
        self.wait_ready()

    def logs_tail(self) -> str:
        return "\n".join(f"--- {c.name}\n{log_text(c, 1500)}" for c in self.children.values())


def worker_blocks(base: str) -> dict[str, float]:
    """Worker -> KV blocks in use, from a gateway's /metrics (empty while it is down)."""
    return {
        labels["worker"]: value
        for labels, value in metric(base, "pdserve_kv_cache_used_blocks").items()
    }


def metric(base: str, name: str) -> dict[dict, float]:
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[_Labels(sample.labels)] = sample.value
    return out


class _Labels(dict):
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def migrations(base: str, reason: str = "worker_lost") -> float:
    found = metric(base, "pdserve_request_migrations_total")
    return sum(v for labels, v in found.items() if labels["reason"] == reason)


async def wait_blocks_free(stack: Stack, timeout: float = 20.0) -> None:
    """No KV block in use on any live worker (nothing leaked by a migration)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = await asyncio.to_thread(worker_blocks, stack.base())
        if set(loads) == stack.live_workers() and not any(loads.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still in use: {loads}"
        await asyncio.sleep(0.1)


async def wait_idle(stack: Stack, timeout: float = 20.0) -> None:
    """Every worker reports no request running or waiting: routing by load is predictable."""
    deadline = time.monotonic() + timeout
    names = ("pdserve_running_requests", "pdserve_waiting_requests")
    while True:
        loads = [await asyncio.to_thread(metric, stack.base(), n) for n in names]
        if all(loads) and not any(v for load in loads for v in load.values()):
            return
        assert time.monotonic() < deadline, f"workers still busy: {loads}"
        await asyncio.sleep(0.1)


class DecodeSpy:
    """Every DecodeRequest on the bus: client request id -> decode workers (and the sampling
    seeds they were given), in order; and every token item sent to a gateway, by bus id."""

    def __init__(self) -> None:
        self.sent: dict[str, list[str]] = defaultdict(list)
        self.seeds: dict[str, list[int | None]] = defaultdict(list)
        self.first: dict[str, DecodeRequest] = {}  # client request id -> its first leg
        self.items: dict[str, list[TokenItem]] = defaultdict(list)
        self.nc = None

    async def start(self, url: str) -> DecodeSpy:
        self.nc = await nats.connect(url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)

        async def on_msg(msg) -> None:
            body = decode(msg.data)
            if isinstance(body, DecodeRequest):
                self.sent[body.client_id].append(msg.subject.rsplit(".", 1)[1])
                self.seeds[body.client_id].append(body.sampling.seed)
                self.first.setdefault(body.client_id, body)
            elif isinstance(body, TokenBatch):
                for item in body.items:
                    self.items[item.bus_id].append(item)

        await self.nc.subscribe("pdserve.decode.*", cb=on_msg)
        await self.nc.subscribe("pdserve.gw.*", cb=on_msg)
        await self.nc.flush()
        return self

    def lost(self, rid: str) -> bool:
        """Whether some token of ``rid``'s first leg, up to the furthest its worker said it
        had sent, never crossed the bus here (once, or again in a replay)."""
        leg = self.first[rid]
        have: dict[int, set[int]] = defaultdict(set)
        upto = {0: len(leg.output_token_ids)}
        for item in self.items[leg.bus_id]:
            if item.error is None:
                end = item.position + len(item.token_ids)
                have[item.index].update(range(item.position, end))
                upto[item.index] = max(upto.get(item.index, 0), end)
        start = {0: len(leg.output_token_ids)}
        return any(set(range(start.get(i, 0), end)) - have[i] for i, end in upto.items())

    def worker_of(self, rid: str) -> str:
        return self.sent[rid][-1]

    async def close(self) -> None:
        await self.nc.close()


async def stream(
    session: aiohttp.ClientSession, base: str, rid: str, body: dict, out: Stream | None = None
) -> Stream:
    """Stream one completion into ``out`` (watchable while it runs)."""
    out = out if out is not None else Stream()
    async with session.post(
        base + "/v1/completions", json={**body, "stream": True}, headers={"x-request-id": rid}
    ) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.decode().strip()
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"]
                    continue
                for choice in event["choices"]:
                    i = choice["index"]
                    if choice["text"]:
                        out.texts[i] += choice["text"]
                        out.times.append(time.monotonic())
                    if choice.get("logprobs"):
                        out.logprobs[i] += choice["logprobs"]["token_logprobs"]
                    if choice["finish_reason"]:
                        out.finish[i] = choice["finish_reason"]
    return out


async def until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
