"""A real ``pdserve up`` with its default topology (1 prefill + 1 decode worker) costs nothing
at rest: after serving disaggregated requests, every process - launcher, NATS, gateway, both
workers - stays under a generous CPU bound while idle. This is a resource test, not a speed
test: the bound (10% of a core) is far above what an idle process uses (<1%) and far below the
full core that a spinning UCX progress loop burnt before ``pdserve.shared.kv.ucx_progress``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.stack import descendants, free_port, pdserve_up, wait_until
from tests.integration.test_up import metric, scrape

REPO = Path(__file__).resolve().parents[2]
IDLE_SECONDS = 5.0
MAX_IDLE_SHARE = 0.10  # of one core
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]


def complete(url: str, prompt: list[int]) -> None:
    body = f'{{"model": "m", "prompt": {prompt}, "max_tokens": 6, "ignore_eos": true}}'
    req = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


@pytest.fixture(scope="module")
def up_default(tmp_path_factory, llama_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("idle") / "up.log"
    env = {"PDSERVE_NUM_KV_BLOCKS": "64", "PDSERVE_DRAIN_SECONDS": "5"}
    env["PDSERVE_SERVED_MODEL_NAME"] = "m"
    # no topology flags: the default is what is under test
    with pdserve_up(["--model", str(llama_dir), "--port", str(port)], log, env) as proc:
        yield proc, f"http://127.0.0.1:{port}", log


def workers(proc: subprocess.Popen) -> dict[str, int]:
    out = {}
    for pid in descendants(proc.pid):
        cmd = command_of(pid)
        for role in ("prefill", "decode", "gateway"):
            if "pdserve.cli" in cmd and cmd.rstrip().endswith(role):
                out[role] = pid
    return out


def test_default_is_one_prefill_and_one_decode_worker_on_cores_of_their_own(up_default):
    proc, url, _ = up_default
    found = workers(proc)
    assert set(found) == {"prefill", "decode", "gateway"}, found
    assert scrape(url).count("pdserve_kv_cache_total_blocks{") == 2
    prefill, decode = (os.sched_getaffinity(found[r]) for r in ("prefill", "decode"))
    if len(os.sched_getaffinity(0)) >= 2:
        assert prefill and decode and not prefill & decode


def test_idle_after_serving_costs_nothing(up_default):
    proc, url, _ = up_default
    for i in range(6):  # long enough to be prefilled remotely and pulled over UCX
        complete(url, list(range(10 + i, 60 + i)))
    wait_until(
        lambda: metric(scrape(url), "pdserve_kv_cache_used_blocks{") == 0, 10, "blocks freed"
    )
    time.sleep(2.0)  # let heartbeats, lease releases and UCX endpoint set-up settle
    pids = [proc.pid, *descendants(proc.pid)]
    before = {pid: cpu_ticks(pid) for pid in pids}
    time.sleep(IDLE_SECONDS)
    used = {pid: (cpu_ticks(pid) - before[pid]) / TICKS / IDLE_SECONDS for pid in pids}
    report = {command_of(pid): round(share, 3) for pid, share in used.items()}
    assert len(pids) >= 5, report  # launcher, nats-server, gateway, prefill, decode
    assert max(used.values()) < MAX_IDLE_SHARE, report


def test_stopping_logs_no_rejected_messages(up_default):
    proc, _, log = up_default
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    text = log.read_text(errors="replace")
    assert "rejected message" not in text, [
        line for line in text.splitlines() if "rejected" in line
    ]
