"""A real ``pdserve up`` for the compatibility runs: free ports, ready line, stopped by its pid.

The stack is stopped by its own pid only (SIGTERM to ``pdserve up``, which stops its children);
afterwards the processes it had started, recorded by pid and start time while it ran, get a
SIGKILL if any outlived it. Nothing is ever looked up or killed by name: other engineers run
their own stacks on this machine at the same time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.services.control.processes import free_port

REPO = Path(__file__).resolve().parents[2]
READY_TEXT = "pdserve ready at"
READY_TIMEOUT_S = 240.0  # the first start converts the GGUF once (~7 s on an idle machine)
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Stack:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT, without /v1
    model: str  # the name the API serves (from /v1/models)
    log: Path


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def descendants(pid: int) -> dict[int, str]:
    """pid -> /proc start time of every live descendant of ``pid``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent_of[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parent_of.items():
            if its_parent == parent and child not in found:
                started = _start_time(child)
                if started is not None:
                    found[child] = started
                    frontier.append(child)
    return found


def _wait_ready(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while READY_TEXT not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"pdserve up not ready after {READY_TIMEOUT_S:.0f} s (log: {log})")
        time.sleep(0.5)


def _served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _stop(proc: subprocess.Popen, family: dict[int, str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
    for pid, started in family.items():
        if _start_time(pid) == started:  # still the process pdserve up started, not a reuse
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def drain_leftovers(log: Path) -> list[str]:
    """Lines of the stack's log where a worker, told to stop after the clients had finished,
    still counted requests in flight or ran out of drain time: a request it never let go."""
    lines = log.read_text(errors="replace").splitlines()
    return [
        line
        for line in lines
        if ("in flight" in line and "finishing 0 in flight" not in line and "draining" in line)
        or "drain time over" in line
    ]


@contextlib.contextmanager
def pdserve_up(
    log: Path, model: str = "smollm2-135m-instruct", extra_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """``pdserve up --model MODEL`` on a free port with /metrics off (no fixed ports at all),
    yielded once it is ready; stopped by its pid afterwards."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(TOKENIZERS_PARALLELISM="false", UCX_WARN_UNUSED_ENV_VARS="n", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *extra_args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    family: dict[int, str] = {}
    try:
        _wait_ready(proc, log)
        family = descendants(proc.pid)
        base_url = f"http://127.0.0.1:{port}"
        yield Stack(proc, base_url, _served_model(base_url), log)
    finally:
        family.update(descendants(proc.pid))
        _stop(proc, family)
