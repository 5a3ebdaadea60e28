"""Real processes for integration tests: nats-server and pdserve services.

Small on purpose. Typical session fixture::

    nats = start_nats(tmp_path_factory.mktemp("nats"))
    p = start_service("prefill", nats.url, logs, env={"PDSERVE_WORKER_ID": "p0"})
    d = start_service("decode", nats.url, logs, env={"PDSERVE_WORKER_ID": "d0"})
    g = start_service("gateway", nats.url, logs, env={"PDSERVE_PORT": str(port)})
    wait_http(f"http://127.0.0.1:{port}/health")
    ...
    stop_all([g, p, d]); nats.stop()

API:
- ``free_port()``: an unused loopback TCP port.
- ``free_port_range(n)``: the first of ``n`` consecutive free ports (worker metrics ports).
- ``start_nats(workdir, **kw) -> NatsServer``: nats-server on a free loopback port; ``.url``,
  ``.stop()``, ``.restart(down_seconds)`` (same port), ``.child.pid``.
- ``start_service(command, nats_url, log_dir, env=None, options=None) -> Child``: runs
  ``python -m pdserve.cli <command>`` in its own process group. ``options`` maps option names
  (``{"num_kv_blocks": 64}``) to values; they travel as ``PDSERVE_*`` env like ``pdserve up``
  does; ``model`` defaults to ``"demo"``. ``Child``: ``.pid``, ``.alive()``, ``.signal(sig)``, ``.wait(t)``, ``.stop(t)`` (SIGTERM
  then SIGKILL of the group), ``.log_text()`` for failure messages.
- ``wait_until(predicate, timeout, what)``; ``wait_http(url, timeout, child=None)``.
- ``stop_all(children)``: SIGTERM every child's process group at once, wait, SIGKILL leftovers.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from pdserve.services.control.launcher import service_argv
from pdserve.services.control.processes import Child, NatsServer, free_port, http_ok, spawn
from pdserve.shared.options import service_env

__all__ = [
    "Child",
    "descendants",
    "pdserve_up",
    "NatsServer",
    "free_port",
    "free_port_range",
    "listening_sockets",
    "log_text",
    "start_nats",
    "start_service",
    "stop_all",
    "wait_http",
    "wait_until",
]

# Test processes stay small and quiet: one torch thread each (2 shared cores), no exporters.
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "PYTHONUNBUFFERED": "1",
    # decode workers step eagerly unless a test asks (env={"PDSERVE_ENFORCE_EAGER": "0"}):
    # compiling the decode step at each of the suite's stack starts would cost it minutes
    "PDSERVE_ENFORCE_EAGER": "1",
}


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive ports free now on loopback.

    Drawn from below the kernel's ephemeral range: ``pdserve up`` hands the worker in slot ``i``
    the metrics port ``base + i`` only when that worker starts, and until then any ``bind(0)``
    (NATS, another worker's UCX listener) or outbound connection could take an ephemeral port.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        base = random.randrange(1024, low - n)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def start_nats(workdir: Path, **kw: object) -> NatsServer:
    nats = NatsServer(log_path=Path(workdir) / "nats.log", workdir=Path(workdir), **kw)
    nats.start()
    return nats


def start_service(
    command: str,
    nats_url: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    options: dict[str, object] | None = None,
    name: str | None = None,
    argv: list[str] | None = None,
) -> Child:
    """``pdserve COMMAND`` (or ``argv``, a stand-in for it) with ``options`` as PDSERVE_*."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    base.update(QUIET_ENV)
    base.update(env or {})
    options = dict(options or {})
    if "model" not in options and "PDSERVE_MODEL" not in base:
        # the random-weight demo model unless a test asks for another: small and fast
        options["model"] = "demo"
    full_env = service_env({"nats_url": nats_url, **options}, base)
    name = name or full_env.get("PDSERVE_WORKER_ID") or command
    log_path = Path(log_dir) / f"{name}.log"
    return spawn(name, argv or service_argv(command), full_env, log_path)


def log_text(child: Child, tail: int = 4000) -> str:
    if child.log_path is None or not child.log_path.exists():
        return ""
    return child.log_path.read_text(errors="replace")[-tail:]


def wait_until(predicate: Callable[[], object], timeout: float, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def wait_http(url: str, timeout: float = 60.0, children: Iterable[Child] = ()) -> None:
    """Wait for a 200 from ``url``; fail at once (with its log) if one of ``children`` dies."""
    children = list(children)
    deadline = time.monotonic() + timeout
    while not http_ok(url, timeout=1.0):
        for child in children:
            if not child.alive():
                raise RuntimeError(
                    f"{child.name} exited with {child.popen.returncode}:\n{log_text(child)}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")
        time.sleep(0.1)


def stop_all(children: Iterable[Child], timeout: float = 10.0) -> None:
    """SIGTERM every child at once (they drain in parallel), then wait; SIGKILL stragglers."""
    children = list(children)
    for child in children:
        if child.alive():
            child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in reversed(children):
        child.stop(max(0.0, deadline - time.monotonic()))


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, read from /proc (no ``ss``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                family = socket.AF_INET if width == 4 else socket.AF_INET6
                found.add((socket.inet_ntop(family, words), int(port_hex, 16)))
    return found


def descendants(pid: int) -> dict[int, str]:
    """pid -> /proc start time of every live descendant of ``pid``."""
    parent_of: dict[int, int] = {}
    start_of: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parent_of[int(entry)] = int(fields[1])
        start_of[int(entry)] = fields[19]
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parent_of.items():
            if parent == p and child not in found:
                found[child] = start_of[child]
                frontier.append(child)
    return found


@contextlib.contextmanager
def pdserve_up(
    args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    ready_text: str = "pdserve ready at",
    timeout: float = 180.0,
) -> Iterator[subprocess.Popen]:
    """A real ``pdserve up ARGS`` (no inherited ``PDSERVE_*`` variables, quiet environment,
    ``env`` on top), yielded once ``ready_text`` is in its log. Afterwards it gets SIGTERM and
    30 s to stop, then every process it left gets SIGKILL."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    full_env.update(QUIET_ENV)
    full_env.pop("OMP_NUM_THREADS", None)  # pdserve up sizes its workers' threads itself
    full_env.pop("MKL_NUM_THREADS", None)
    full_env.update(env or {})
    argv = [sys.executable, "-m", "pdserve.cli", "up", *args]
    repo = Path(__file__).resolve().parents[2]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=repo, env=full_env, stdout=out, stderr=subprocess.STDOUT)

    def ready() -> bool:
        text = log.read_text(errors="replace")
        assert proc.poll() is None, f"pdserve up exited:\n{text[-4000:]}"
        return ready_text in text

    try:
        wait_until(ready, timeout, f"{ready_text!r} in the log of pdserve up")
        yield proc
    finally:
        family = descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for pid in family:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
