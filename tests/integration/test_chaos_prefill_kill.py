"""A prefill worker SIGKILLed while a decode worker pulls its KV (#47): the decode worker learns
of it within ``--kv-pull-timeout``, applies ``--kv-failure-policy recompute`` (prefills the
prompt itself), and the stream completes with the answer an undisturbed run gives; no block is
left held anywhere, and the other prefill worker serves on.

Two prefill workers and one decode worker (``chaos_stack.py``). The prefill side's answer to a
pull is held back (the ``pull_answer`` gate, ``staged_worker.py``), so the pull is in flight -
posted, admitted, its lease pinned - when the worker holding the lease is killed. In the
streamed case the prompt is long enough to be pulled layer by layer and its prefill is slow, so
the kill lands while layers are still being written and sent.

Under ``--kv-failure-policy reprefill`` (the last tests, which restart the decode worker with it)
the decode worker cannot recompute: it hands the failed pull back, the gateway prefills the
prompt again on the surviving prefill worker (its log names it) and the stream still completes
with the undisturbed answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import aiohttp
import pytest

from tests.integration.chaos_stack import ChaosStack
from tests.integration.stack import log_text

PULL_TIMEOUT = 3.0
STREAM_THRESHOLD = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    s = ChaosStack(
        tmp_path_factory.mktemp("chaos-kill"),
        llama_dir,
        prefill=("p0", "p1"),
        decode=("d0",),
        worker_options={
            "kv_pull_timeout": PULL_TIMEOUT,
            "kv_stream_threshold": STREAM_THRESHOLD,
            "lease_seconds": 60.0,
        },
    )
    s.start()
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def prompt(tokens: int, salt: int) -> list[int]:
    return [(11 * i + salt) % 300 + 20 for i in range(tokens)]


async def stream_text(base: str, ids: list[int], times: list[float]) -> tuple[str, str | None]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, finish = "", None
        async with session.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    choice = chunk["choices"][0]
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
                    times.append(time.monotonic())
        return text, finish


async def reset_prefix_caches(base: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(f"{base}/reset_prefix_cache") as r:
        assert r.status == 200, await r.text()


async def kill_mid_pull(stack, ids: list[int], pull: str) -> tuple[str, str | None, str, float]:
    """Stream ``ids`` while the prefill worker whose KV the decode worker pulls is SIGKILLed
    mid-pull: (text, finish reason, the victim, seconds from the kill to the next token)."""
    stack.gate("pull_answer", 60.0)
    if pull == "streamed":
        stack.gate("prefill.step", 0.3)
    times: list[float] = []
    task = asyncio.create_task(stream_text(stack.base, ids, times))
    try:
        deadline = time.monotonic() + 30
        while True:  # the decode worker reserved its blocks: the pull is posted
            held = stack.held()
            lessor = [p for p in ("p0", "p1") if p in held and held[p].blocks]
            if lessor and "d0" in held and held["d0"].blocks:
                break
            assert not task.done() and time.monotonic() < deadline, f"no pull in flight: {held}"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # its pull request admitted over there
        (victim,) = lessor
        stack.children[victim].signal(signal.SIGKILL)
        killed = time.monotonic()
        stack.ungate_all()  # the survivor is not slowed
        text, finish = await asyncio.wait_for(task, 60)
    finally:
        stack.ungate_all()
        task.cancel()
    after_kill = [t - killed for t in times if t > killed]
    return text, finish, victim, after_kill[0]


async def restart_victim(stack, victim: str) -> None:
    """The other prefill worker serves on; the victim restarts under its id, as a supervisor's
    restart would, and nothing stays held."""
    await asyncio.to_thread(stack.wait_idle, 15)  # nothing held by the living
    again, _ = await stream_text(stack.base, prompt(100, salt=7), [])  # served by the survivor
    assert again
    stack.start_worker(victim)
    stack.wait_ready()
    await asyncio.to_thread(stack.wait_idle, 15)
    assert stack.live_workers() == {"p0", "p1", "d0"}


async def reference_then_cold(stack, ids: list[int]) -> str:
    """The undisturbed answer for ``ids``; then no cache holds it, so it is pulled again."""
    stack.wait_idle(30)
    reference, finish = await stream_text(stack.base, ids, [])
    assert finish == "length"
    await reset_prefix_caches(stack.base)  # the decode worker must pull it again, all of it
    stack.wait_idle(30)
    return reference


@pytest.mark.parametrize("pull", ["bulk", "streamed"])
async def test_a_prefill_worker_killed_mid_pull(stack, pull):
    ids = prompt(160 if pull == "bulk" else 320, salt=len(pull))
    reference = await reference_then_cold(stack, ids)
    text, finish, victim, first = await kill_mid_pull(stack, ids, pull)
    print(f"{pull}: a token {first:.2f}s after the kill of {victim}")
    assert (text, finish) == (reference, "length")
    assert first <= PULL_TIMEOUT + 3.0  # learnt within the pull timeout, then prefilled
    await restart_victim(stack, victim)


@pytest.mark.parametrize("pull", ["bulk", "streamed"])
async def test_a_prefill_worker_killed_mid_pull_is_prefilled_again(stack, pull):
    """``--kv-failure-policy reprefill``: the decode worker hands the failed pull back, and the
    gateway prefills the prompt again on the other prefill worker - not on the decode worker,
    whose engine cannot recompute under this policy - and the stream completes unchanged."""
    gateway = stack.children["gw"]
    if stack.worker_options["kv_failure_policy"] != "reprefill":
        stack.children["d0"].stop(30)
        stack.worker_options["kv_failure_policy"] = "reprefill"  # and for its restarts
        stack.start_worker("d0")
        stack.wait_ready()
    ids = prompt(160 if pull == "bulk" else 320, salt=13 + len(pull))
    reference = await reference_then_cold(stack, ids)
    before = log_text(gateway, 10**7)
    text, finish, victim, first = await kill_mid_pull(stack, ids, pull)
    print(f"{pull}: a token {first:.2f}s after the kill of {victim}")
    assert (text, finish) == (reference, "length")
    survivor = ({"p0", "p1"} - {victim}).pop()
    news = log_text(gateway, 10**7)[len(before) :]
    assert f"its KV could not be pulled from {victim}" in news, news[-3000:]
    assert re.search(rf"prefilled \S+ again on {survivor}\b", news), news[-3000:]
    assert first <= PULL_TIMEOUT + 3.0
    await restart_victim(stack, victim)
