"""A client that hangs up at each stage of a disaggregated request (#47): the work stops on every
worker within a bound and every KV block comes back, on the prefill side (its lease) and on the
decode side (the blocks it reserved for the pull).

One prefill and two decode workers (``chaos_stack.py``), each a real worker whose stages a gate
file slows (``staged_worker.py``), so that the request is caught in the stage under test and not
a moment later; a second decode worker takes the request that migrates when its first one is
killed. Prompts of 256 tokens or more are pulled layer by layer
(``--kv-stream-threshold 256``), shorter ones in bulk. The gateway keeps no queue of its own
(beyond ``--max-queue`` it answers 503): a request queues on a worker, behind another one.

The stop time - hang-up to no worker holding a block or a sequence, as the gateway's /metrics
sees it (heartbeats every 0.1 s) - is printed; ``STOP_TIMES_OUT`` names a JSON file to add it
to (``perf/results/abort_stop_times.json``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from tests.integration.chaos_stack import ChaosStack, Held

STOP_BOUND = 5.0  # seconds from the hang-up until every worker let the request go
STEP = 0.3  # a gated forward pass
STREAM_THRESHOLD = 256
SHORT, LONG = 160, 320  # prompt tokens: a bulk pull, a layer-streamed one


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    s = ChaosStack(
        tmp_path_factory.mktemp("chaos-aborts"),
        llama_dir,
        decode=("d0", "d1"),
        worker_options={"kv_stream_threshold": STREAM_THRESHOLD},
    )
    s.start()
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def prompt(tokens: int, rid: str) -> list[int]:
    """Its own first block for each request id: no stage is shortened by a prefix cache hit."""
    salt = zlib.crc32(rid.encode()) % 199 + 1
    return [(7 * i + salt) % 200 + 20 for i in range(tokens)]


async def complete(base: str, rid: str, tokens: int, max_tokens: int, seen: list) -> None:
    body = {
        "model": await model_name(base),
        "prompt": prompt(tokens, rid),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/completions", json=body, headers={"x-request-id": rid}) as r,
    ):
        async for line in r.content:
            if line.startswith(b"data: {"):
                seen.append(time.monotonic())


async def model_name(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def holds(stack: ChaosStack, worker: str, test: Callable[[Held], bool]) -> Callable[[], bool]:
    """Whether ``worker`` ("d" for any decode worker) holds what ``test`` asks."""

    def check() -> bool:
        held = stack.held()
        names = [w for w in held if w.startswith("d")] if worker == "d" else [worker]
        return any(n in held and test(held[n]) for n in names)

    return check


def decoders_holding(stack: ChaosStack) -> list[str]:
    return [w for w, h in stack.held().items() if w.startswith("d") and h.blocks]


# stage -> (gates, prompt tokens, max tokens, when the request is in that stage)
STAGES: dict[str, tuple[dict[str, float], int, int, Callable[[ChaosStack, list], object]]] = {
    # behind a long prompt whose chunks take STEP each (the blocker, below)
    "queued": (
        {"prefill.step": STEP},
        SHORT,
        4,
        lambda s, seen: holds(s, "p0", lambda h: h.waiting >= 1)(),
    ),
    "prefilling": (  # four chunks of two STEPs: caught in the first three
        {"prefill.step": 2 * STEP},
        240,
        4,
        lambda s, seen: holds(s, "p0", lambda h: h.running >= 1 and h.blocks >= 2)(),
    ),
    # the decode worker reserved its blocks; the prefill worker holds the lease; no pull yet
    "before_pull": (
        {"pull_start": 30.0},
        SHORT,
        4,
        lambda s, seen: (
            holds(s, "d", lambda h: h.blocks >= 1)() and holds(s, "p0", lambda h: h.blocks >= 1)()
        ),
    ),
    # the pull is posted and admitted (its lease pinned); the bytes are late
    "bulk_pull": (
        {"pull_answer": 30.0},
        SHORT,
        4,
        lambda s, seen: (
            holds(s, "d", lambda h: h.blocks >= 1)() and holds(s, "p0", lambda h: h.blocks >= 1)()
        ),
    ),
    "streamed_pull": (
        {"prefill.step": STEP, "pull_answer": 30.0},
        LONG,
        4,
        lambda s, seen: holds(s, "d", lambda h: h.blocks >= 1)(),
    ),
    "decoding": ({"decode.step": STEP}, SHORT, 200, lambda s, seen: len(seen) >= 3),
    # its decode worker killed mid-stream; the gateway sent it to the other one (below)
    "migrating": ({"decode.step": STEP}, SHORT, 200, lambda s, seen: len(seen) >= 3),
}


@pytest.mark.parametrize("stage", list(STAGES))
async def test_a_hang_up_stops_the_work_and_frees_every_block(stack, stage):
    gates, tokens, max_tokens, caught = STAGES[stage]
    stack.wait_idle(30)
    for name, seconds in gates.items():
        stack.gate(name, seconds)
    blocker = leaver = None
    try:
        if stage == "queued":  # a long prompt prefilling in slow chunks holds the worker
            blocker = asyncio.create_task(complete(stack.base, "blocker", 480, 1, []))
            await until(holds(stack, "p0", lambda h: h.running >= 1), "the blocker prefilling")
        seen: list[float] = []
        leaver = asyncio.create_task(
            complete(stack.base, f"leaver-{stage}", tokens, max_tokens, seen)
        )
        await until(lambda: caught(stack, seen) or leaver.done(), f"the request {stage}")
        assert not leaver.done(), f"it ended before it was caught {stage}: {leaver!r}"
        if stage == "migrating":
            (victim,) = decoders_holding(stack)
            stack.children[victim].signal(signal.SIGKILL)
            heir = {"d0": "d1", "d1": "d0"}[victim]
            await until(holds(stack, heir, lambda h: h.blocks >= 1), "the migrated leg")
        leaver.cancel()  # the client hangs up: its connection closes
        hung_up = time.monotonic()
        if stage == "queued":  # it leaves the queue while the blocker still runs
            await until(
                holds(stack, "p0", lambda h: not h.waiting), "the queue empty", 4 * STOP_BOUND
            )
            stopped = time.monotonic() - hung_up
            assert holds(stack, "p0", lambda h: h.running >= 1)(), "the blocker ended first"
            assert blocker is not None
            blocker.cancel()
            await asyncio.to_thread(stack.wait_idle, 4 * STOP_BOUND)
        else:
            stopped = await asyncio.to_thread(stack.wait_idle, 4 * STOP_BOUND, hung_up)
    finally:
        stack.ungate_all()
        for task in (blocker, leaver):
            if task is not None:
                task.cancel()
    record(stage, stopped)
    assert stopped <= STOP_BOUND, f"{stage}: the workers held it {stopped:.1f}s after the hang-up"
    for name in {"p0", "d0", "d1"} - stack.live_workers():  # the migration's victim: restarted
        stack.start_worker(name)
    await asyncio.to_thread(stack.wait_ready)
    await asyncio.to_thread(stack.wait_idle, 10)


def record(stage: str, seconds: float) -> None:
    print(f"abort {stage}: work stopped {seconds:.2f}s after the hang-up")
    out = os.environ.get("STOP_TIMES_OUT")
    if out:
        path = Path(out)
        found = json.loads(path.read_text()) if path.exists() else {}
        found[stage] = round(seconds, 3)
        path.write_text(json.dumps(found, indent=2) + "\n")
