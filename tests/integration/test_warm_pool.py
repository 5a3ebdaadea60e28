"""The warm pool end to end on the demo model: ``pdserve up --autoscale --warm-decode-workers 1``
with real nats-server, workers, gateway and HTTP (the planner's profile is test_autoscale's: one
decode worker does 40 tok/s, so three clients need two).

- the pooled worker (decode-1) loads and registers but gets no request while light traffic is
  served, and sits near 0% CPU (its /proc/PID/stat);
- under load the planner scales up by promoting it (SIGUSR1): it serves at once, and the pool is
  refilled by a cold start (decode-2);
- promotion -> its first decode step is far below a cold start (start -> registered, a lower
  bound of a cold start's time to first token). Both are printed.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import aiohttp

from pdserve.services.control.launch_checks import registered_names
from tests.integration.stack import free_port, free_port_range, pdserve_up, wait_until
from tests.integration.test_autoscale import load, write_profile
from tests.integration.test_up import scrape

STEPS = 'pdserve_worker_decode_step_seconds_count{role="decode"}'


def decode_steps(metrics_url: str) -> float:
    for line in scrape(metrics_url).splitlines():
        if line.startswith(STEPS + " "):
            return float(line.rsplit(" ", 1)[1])
    return -1.0  # not answering (yet)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def pid_of(text: str, worker: str) -> int:
    found = re.search(rf"started {worker} \(pid (\d+)\)", text)
    assert found, text[-3000:]
    return int(found.group(1))


async def few_requests(gateway: str, n: int) -> list[int]:
    body = {
        "model": "pdserve-demo-llama-v1",
        "prompt": "warm",
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0,
    }
    statuses = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for _ in range(n):
            async with session.post(gateway + "/v1/completions", json=body) as resp:
                await resp.read()
                statuses.append(resp.status)
    return statuses


async def test_a_pooled_worker_idles_unrouted_then_serves_at_once_when_promoted(
    tmp_path: Path,
) -> None:
    port, metrics_base = free_port(), free_port_range(3)
    gateway = f"http://127.0.0.1:{port}"
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
        "--max-decode-workers",
        "2",
        "--warm-decode-workers",
        "1",
        "--autoscale-max-cpus",
        str(4 * share),
        "--autoscale-interval",
        "2",
        "--planner-warmup-seconds",
        "0",
        "--slo-itl-ms",
        "50",
        "--metrics-port",
        str(metrics_base),
    ]
    env = {"PDSERVE_HEARTBEAT_SECONDS": "0.2", "PDSERVE_DRAIN_SECONDS": "20"}
    log = tmp_path / "up.log"
    # slots in start order: prefill-0, decode-0, then the pool's decode-1 (metrics port + slot)
    pooled = f"http://127.0.0.1:{metrics_base + 2}"
    with pdserve_up(args, log, env):
        text = log.read_text(errors="replace")
        assert "started decode-1" in text and "for the warm pool" in text, text[-3000:]
        assert {"prefill-0", "decode-0", "decode-1"} <= registered_names(gateway)  # ready waits

        # light traffic: served, never by the pooled worker; which idles meanwhile
        pid = pid_of(text, "decode-1")
        cpu_before, at = cpu_seconds(pid), time.monotonic()
        assert set(await few_requests(gateway, 4)) == {200}
        await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - at)))
        idle_cpu = (cpu_seconds(pid) - cpu_before) / (time.monotonic() - at)
        assert decode_steps(pooled) == 0.0, scrape(pooled)[-2000:]
        assert idle_cpu < 0.05, f"a standby worker used {idle_cpu:.1%} of a CPU"

        # load: the planner promotes decode-1, which serves; decode-2 refills the pool
        stop = asyncio.Event()
        running = asyncio.create_task(load(gateway, stop))
        await asyncio.to_thread(
            wait_until,
            lambda: "promoted decode-1" in log.read_text(errors="replace"),
            60,
            "the promotion",
        )
        promoted_at = time.monotonic()  # the refill (decode-2) starts in the same breath
        await asyncio.to_thread(wait_until, lambda: decode_steps(pooled) > 0, 30, "its first step")
        warm = time.monotonic() - promoted_at
        await asyncio.to_thread(
            wait_until, lambda: "decode-2" in registered_names(gateway), 120, "decode-2 registered"
        )
        cold = time.monotonic() - promoted_at
        stop.set()
        results = await running
        text = log.read_text(errors="replace")

    print(
        f"warm pool: promotion -> first decode step {warm:.2f} s; cold start -> registered "
        f"{cold:.2f} s; standby CPU {idle_cpu:.2%}"
    )
    assert set(results) == {(200, 32)}, results
    assert warm < cold / 2, (warm, cold)
    assert "decode-2" in text and re.search(r"started decode-2 .*for the warm pool", text)
    assert not re.search(r"pdserve: decode-\d+ exited with", text), text[-3000:]
