"""A drain that loses nothing (issue 31): real NATS, two prefill and two decode workers, a
gateway, real UCX; SIGTERM as Kubernetes sends it when it deletes a pod.

- A prefill worker told to stop while decode workers still have to pull KV it holds under lease
  takes no new prompts, keeps serving those pulls, and exits only when they are done: every
  stream ends normally, each text equals the undisturbed run's (float64, greedy), and no pull
  failed or was recomputed (the decode workers' counters stay 0 - with the policy
  ``recompute`` a lost pull would otherwise go unseen in the answers).
- A decode worker told to stop finishes what it can within ``--drain-seconds`` (0 here: nothing)
  and leaves; the gateway moves the rest of its streams, which go on exactly where they were.
  (Finishing them in full within the drain: tests/integration/test_workers.py.)

The decode workers' KV pools hold four requests at a time, so most requests wait there for
blocks while their KV sits leased on the prefill workers: the SIGTERM falls among those pulls
(the draining worker's /ready shows the leases it still holds).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from tests.integration.migration_stack import (
    DecodeSpy,
    Stream,
    metric,
    migrations,
    stream,
    until,
)
from tests.integration.stack import (
    Child,
    free_port,
    log_text,
    start_nats,
    start_service,
    stop_all,
    wait_until,
)

WORKER_OPTIONS = {
    "dtype": "float64",  # a different batch shape or a re-prefill cannot flip a greedy token
    "block_size": 16,
    "max_num_batched_tokens": 1024,
    "heartbeat_seconds": 0.2,
    "lease_seconds": 120.0,  # a lease never runs out here: a lost pull is the drain's doing
}
DECODE_OPTIONS = {
    "num_kv_blocks": 72,  # four requests of ~150 + 60 tokens at a time
    "kv_failure_policy": "recompute",  # a failed pull would be hidden in the text, not counted
    "drain_seconds": 0.0,  # leave at once: every stream still running must move
}
PREFILL_OPTIONS = {"drain_seconds": 120.0}
GATEWAY_OPTIONS = {"worker_timeout": 1.5, "request_timeout": 240.0}
WORKERS = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
TEXT = "Paged attention keeps the keys and values of every token in fixed-size blocks. "


def body(i: int, max_tokens: int, repeat: int = 5) -> dict:
    return {
        "model": "llama-gqa",
        "prompt": f"{i}: " + TEXT * repeat,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


class Stack:
    def __init__(self, tmp_path_factory, llama_dir) -> None:
        self.logs = tmp_path_factory.mktemp("drain-logs")
        self.nats = start_nats(self.logs)
        self.metrics = {name: free_port() for name in WORKERS}
        self.children: dict[str, Child] = {}
        for name, role in WORKERS.items():
            extra = DECODE_OPTIONS if role == "decode" else PREFILL_OPTIONS
            options = {
                **WORKER_OPTIONS,
                **extra,
                "model": str(llama_dir),
                "worker_id": name,
                "metrics_port": self.metrics[name],
            }
            self.children[name] = start_service(role, self.nats.url, self.logs, options=options)
        port = free_port()
        options = {**GATEWAY_OPTIONS, "model": str(llama_dir), "port": port}
        self.children["gw"] = start_service("gateway", self.nats.url, self.logs, options=options)
        self.base = f"http://127.0.0.1:{port}"

    def ready(self, name: str) -> tuple[int, dict]:
        return get_json(f"http://127.0.0.1:{self.metrics[name]}/ready")

    def wait_ready(self) -> None:
        def up() -> bool:
            for child in self.children.values():
                assert child.alive(), f"{child.name} died:\n{log_text(child)}"
            workers = metric(self.base, "pdserve_kv_cache_used_blocks")
            return len(workers) == len(WORKERS) and all(self.ready(n)[0] == 200 for n in WORKERS)

        wait_until(up, 180, "every worker ready and known to the gateway")

    def counter(self, name: str, series: str) -> float:
        return sum(metric(f"http://127.0.0.1:{self.metrics[name]}", series).values())


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    s = Stack(tmp_path_factory, llama_dir)
    try:
        s.wait_ready()
        yield s
    finally:
        stop_all(list(s.children.values()), timeout=30)
        s.nats.stop()


async def run_all(base: str, bodies: dict[str, dict], out: dict[str, Stream]) -> None:
    async with aiohttp.ClientSession() as session:

        async def one(rid: str, b: dict) -> None:
            await stream(session, base, rid, b, out.setdefault(rid, Stream()))

        await asyncio.gather(*(one(rid, b) for rid, b in bodies.items()))


def assert_same(got: dict[str, Stream], reference: dict[str, Stream]) -> None:
    for rid, want in reference.items():
        out = got[rid.removeprefix("ref-")]
        assert out.error is None and out.done, (rid, out.error)
        assert out.finish == want.finish == {0: "length"}, rid
        assert dict(out.texts) == dict(want.texts), rid


async def test_a_prefill_worker_drains_its_kv_pulls_and_loses_nothing(stack) -> None:
    bodies = {f"pd-{i}": body(i, 60) for i in range(24)}
    reference: dict[str, Stream] = {}
    await run_all(stack.base, {f"ref-{r}": b for r, b in bodies.items()}, reference)
    assert all(r.error is None and r.done for r in reference.values())

    results: dict[str, Stream] = {}
    task = asyncio.create_task(run_all(stack.base, bodies, results))
    # SIGTERM while p0 holds KV that decode workers have not pulled yet
    await until(lambda: stack.ready("p0")[1].get("leases", 0) >= 2, "leases on p0", 60)
    stack.children["p0"].signal(signal.SIGTERM)
    signalled = time.monotonic()
    status, at_drain = await asyncio.to_thread(stack.ready, "p0")
    while at_drain.get("status") != "draining":
        assert time.monotonic() - signalled < 10, at_drain
        status, at_drain = await asyncio.to_thread(stack.ready, "p0")
    assert status == 503 and at_drain["leases"] >= 1  # pulls of its KV still to come

    await asyncio.wait_for(task, 180)
    assert_same(results, reference)
    for name in ("d0", "d1"):  # every pull succeeded: nothing failed, nothing was prefilled again
        assert stack.counter(name, "pdserve_kv_pull_failures_total") == 0, name
        assert stack.counter(name, "pdserve_kv_recomputes_total") == 0, name
    p0 = stack.children["p0"]
    assert await asyncio.to_thread(p0.wait, 30) == 0, log_text(p0)  # left once they were pulled
    assert "drain time over" not in log_text(p0, 100_000)


async def test_a_decode_worker_drains_and_its_streams_move(stack) -> None:
    bodies = {f"dd-{i}": body(100 + i, 400, repeat=1) for i in range(4)}
    reference: dict[str, Stream] = {}
    await run_all(stack.base, {f"ref-{r}": b for r, b in bodies.items()}, reference)
    spy = await DecodeSpy().start(stack.nats.url)
    try:
        results: dict[str, Stream] = {}
        task = asyncio.create_task(run_all(stack.base, bodies, results))
        await until(
            lambda: (
                len(results) == len(bodies) and all(s.tokens_seen() >= 5 for s in results.values())
            ),
            "tokens",
            120,
        )
        where = {rid: spy.worker_of(rid) for rid in bodies}
        victim = max(set(where.values()), key=list(where.values()).count)
        running = {rid for rid, w in where.items() if w == victim and not results[rid].finish}
        before = migrations(stack.base)
        stack.children[victim].signal(signal.SIGTERM)
        await asyncio.wait_for(task, 180)
    finally:
        await spy.close()
    assert_same(results, reference)
    moved = {rid for rid in bodies if len(spy.sent[rid]) > 1}
    assert moved and moved <= running  # only the victim's streams moved, each once
    assert migrations(stack.base) - before == len(moved)
    for rid in moved:
        assert spy.sent[rid] == [victim, spy.sent[rid][-1]] and spy.sent[rid][-1] != victim
    child = stack.children[victim]
    assert await asyncio.to_thread(child.wait, 30) == 0, log_text(child)
    assert "drain time over" in log_text(child, 100_000)  # it left with streams running
