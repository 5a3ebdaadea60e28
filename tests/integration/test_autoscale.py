"""``pdserve up --autoscale`` end to end on the demo model: real nats-server, workers, gateway
and HTTP; the planner reads the gateway's /metrics every 2 s.

The profile is the test's own: one decode worker does 40 tok/s (batch 1 at 25 ms, and any larger
batch misses the ITL target), prefill never binds. So three clients asking for 32 tokens at a time
(several requests a second on any machine) need two decode workers, and an idle stack one. Under
that load a second decode worker starts and registers, and the planner's
``pdserve_planner_desired_workers{role="decode"}`` says 2; once the load stops, one decode worker
is drained (SIGTERM: it leaves the registry and exits by itself, and ``pdserve up`` does not take
that for a crash) and everything says 1 again. Every request of the load completed with 200 and
all its tokens."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import aiohttp

from pdserve.services.control.planner.profile import Profile
from tests.integration.stack import free_port, pdserve_up, wait_until
from tests.integration.test_up import scrape

MAX_TOKENS = 32
CLIENTS = 3


def write_profile(path: Path) -> Path:
    Profile(
        prefill_lens=(1, 4096),
        prefill_tokens_per_s=(1e6, 1e6),
        decode_batches=(1, 2),
        decode_contexts=(16, 4096),
        decode_itl_ms=((25.0, 25.0), (1e5, 1e5)),
        kv_capacity_tokens=100_000,
        model="pdserve-demo",
        note="test_autoscale: 40 tok/s per decode worker",
    ).save(path)
    return path


def value(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def decode_workers(gateway: str) -> int:
    """Decode workers in the gateway's registry (its re-export of their loads)."""
    return scrape(gateway).count('pdserve_kv_cache_total_blocks{role="decode"')


def planner(port: int, what: str) -> float | None:
    return value(scrape(f"http://127.0.0.1:{port}"), f'pdserve_planner_{what}{{role="decode"}}')


async def load(gateway: str, until: asyncio.Event) -> list[tuple[int, int]]:
    """CLIENTS clients, each one request after another, until ``until`` is set: (status,
    completion tokens) of every request."""
    results: list[tuple[int, int]] = []
    body = {
        "model": "pdserve-demo-llama-v1",
        "prompt": "scale me " * 6,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def client(session: aiohttp.ClientSession) -> None:
        while not until.is_set():
            async with session.post(gateway + "/v1/completions", json=body) as resp:
                data = await resp.json(content_type=None)
                tokens = (data.get("usage") or {}).get("completion_tokens", 0)
                results.append((resp.status, tokens))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
    return results


async def watch(what, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__}"
        await asyncio.sleep(0.25)


async def test_scales_decode_up_under_load_and_drains_back_when_idle(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    gateway = f"http://127.0.0.1:{port}"
    # 1P1D take the CPU shares pdserve up gives them; the budget holds one more worker's share
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    args = [
        "--model",
        "demo",
        "--port",
        str(port),
        "--autoscale",
        "--planner-profile",
        str(write_profile(tmp_path / "profile.json")),
        "--max-prefill-workers",
        "1",
        "--min-decode-workers",
        "1",
        "--max-decode-workers",
        "2",
        "--autoscale-max-cpus",
        str(3 * share),
        "--autoscale-interval",
        "2",
        "--planner-warmup-seconds",
        "4",
        "--slo-itl-ms",
        "50",
        "--planner-metrics-port",
        str(metrics_port),
    ]
    env = {"PDSERVE_HEARTBEAT_SECONDS": "0.2", "PDSERVE_DRAIN_SECONDS": "20"}
    log = tmp_path / "up.log"
    with pdserve_up(args, log, env):
        wait_until(lambda: planner(metrics_port, "desired_workers") == 1, 10, "planner metrics")
        assert decode_workers(gateway) == 1

        stop = asyncio.Event()
        running = asyncio.create_task(load(gateway, stop))

        def scaled_up() -> bool:
            """a second decode worker, registered, and the planner saying 2"""
            assert not running.done(), running.result()  # a client failed: see why
            return (
                decode_workers(gateway) == 2
                and planner(metrics_port, "desired_workers") == 2
                and planner(metrics_port, "current_workers") == 2
            )

        await watch(scaled_up, 60)
        await asyncio.sleep(3)  # the new worker serves its share for a few windows
        stop.set()
        results = await running

        def drained() -> bool:
            """one decode worker again: drained, reaped, out of the registry"""
            return (
                planner(metrics_port, "desired_workers") == 1
                and planner(metrics_port, "current_workers") == 1
                and planner(metrics_port, "draining_workers") == 0
                and decode_workers(gateway) == 1
            )

        await watch(drained, 60)
        text = log.read_text(errors="replace")

    assert len(results) >= 10 and set(results) == {(200, MAX_TOKENS)}, results
    assert "pdserve autoscale: started decode-1" in text
    assert "drained and exited (0)" in text, text[-3000:]
    # a worker the autoscaler stopped is not reported as a crash by pdserve up's supervision
    assert not re.search(r"pdserve: decode-\d+ exited with", text), text[-3000:]
