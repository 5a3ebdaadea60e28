"""``pdserve up``: NATS, prefill workers, decode workers and the gateway on one machine.

Each service runs as its own process (``python -m pdserve.cli <cmd>``) in its own process group,
exactly as compose runs them, so local runs exercise the real wiring. Options reach the children
as ``PDSERVE_*`` environment variables (secrets stay out of ``ps``). Children get SIGTERM from the
kernel if the launcher itself dies (PR_SET_PDEATHSIG), and on Ctrl-C/SIGTERM the launcher stops
the gateway, lets workers drain, then stops NATS: nothing is left behind.

CPUs: with at least as many CPUs as workers, each worker runs on a share of its own
(``cpu_shares``, sched affinity) and sizes its torch thread pool to that share, so two workers'
GEMMs never preempt each other (on 2 cores, 1P1D: one core each). With fewer CPUs, the workers
share them all and split the thread count instead. The gateway and NATS, light and mostly
waiting, float. ``--no-split-cpus`` and ``--torch-threads`` override both.

NATS: one private nats-server, or with ``--nats-cluster N`` N nodes routed to each other on
loopback (a way to try a cluster, and to watch a node die: each worker connects to node
``slot % N`` first and lists the others for failover; the gateway prefers node 1). The launcher
keeps serving while at least one node lives.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.services.processes import Child, NatsCluster, NatsServer, http_ok, spawn
from pdserve.shared.config import (
    BusConfig,
    EngineConfig,
    GatewayConfig,
    UpConfig,
    WorkerConfig,
    build,
    env_name,
)

READY_TIMEOUT = 600.0  # loading a large model can take minutes
STOP_GRACE = 5.0  # beyond the drain time, before SIGKILL


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


def gpu_for_worker(index: int, gpus: list[str]) -> str | None:
    """Round-robin over the GPUs in start order (prefill workers first, then decode), so with
    as many GPUs as workers prefill and decode never share one. None: leave placement alone."""
    if len(gpus) < 2:
        return None
    return gpus[index % len(gpus)]


def cpu_shares(cpus: list[int], workers: int) -> list[list[int]] | None:
    """Split ``cpus`` into one contiguous share per worker (prefill workers, which start first,
    take the remainder: prefill is the compute-bound phase); None when there are fewer CPUs than
    workers, which then share them all."""
    if workers < 1 or len(cpus) < workers:
        return None
    size, extra = divmod(len(cpus), workers)
    shares, start = [], 0
    for i in range(workers):
        end = start + size + (1 if i < extra else 0)
        shares.append(cpus[start:end])
        start = end
    return shares


def registered_workers(base_url: str) -> int:
    """Workers the gateway knows, from its re-export of their loads on /metrics."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=2.0) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return 0
    return sum(1 for line in text.splitlines() if line.startswith("pdserve_kv_cache_total_blocks{"))


def service_env(values: dict[str, object], base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment that hands option values to a child ``pdserve`` command."""
    env = dict(os.environ if base is None else base)
    for name, value in values.items():
        key = env_name(name)
        if value is None:
            env.pop(key, None)
        elif isinstance(value, bool):
            env[key] = "true" if value else "false"
        elif isinstance(value, list):
            env[key] = ",".join(str(v) for v in value)
        else:
            env[key] = str(value)
    return env


def service_argv(command: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", command]


def _values(*configs: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for cfg in configs:
        out.update(dataclasses.asdict(cfg))
    return out


class Launcher:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.up = build(UpConfig, ns)
        self.gateway = build(GatewayConfig, ns)
        self.engine = build(EngineConfig, ns)
        self.worker = build(WorkerConfig, ns)
        self.bus = build(BusConfig, {**vars(ns), "nats_url": self.up.nats_url or "unset"})
        self.nats: NatsServer | None = None
        self.nats_cluster: NatsCluster | None = None
        self.model = None  # model_resolve.ResolvedModel, set by start()
        self.gpus: list[str] = []
        self.children: list[Child] = []
        self.cpu_shares: list[list[int]] | None = None  # per worker, in start order
        self.stopping = False
        self.force = False

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.stopping:  # a second Ctrl-C: stop waiting for drains
            self.force = True
            print("pdserve: forcing shutdown", file=sys.stderr, flush=True)
        self.stopping = True

    def start(self) -> None:
        # Resolve (and on first use convert) the model once, here, so the workers and the
        # gateway start from the cache instead of all converting a GGUF at the same time.
        from pdserve.shared.models.resolve import resolve

        self.model = resolve(self.engine.model)
        if self.up.nats_url:
            nats_url = self.up.nats_url
        elif self.up.nats_cluster > 1:
            self.nats_cluster = self._start_cluster()
            nats_url = self.nats_cluster.url
        else:
            self.nats = NatsServer(
                max_payload=self.bus.max_message_bytes,
                token=self.bus.nats_token,
                user=self.bus.nats_user,
                password=self.bus.nats_password,
            )
            # its chatter goes to a file; the services' logs stay readable on the terminal
            self.nats.log_path = self.nats.workdir / "nats-server.log"
            self.nats.start()
            nats_url = self.nats.url
        bus = dataclasses.replace(self.bus, nats_url=nats_url)
        common = _values(bus, self.engine)
        self.gpus = visible_gpus() if self.engine.device == "auto" else []
        cpus = sorted(os.sched_getaffinity(0))
        workers = self.up.prefill_workers + self.up.decode_workers
        self.cpu_shares = cpu_shares(cpus, workers) if self.up.split_cpus else None
        if self.cpu_shares is None and not self.engine.torch_threads and workers:
            # sharing every CPU: together the workers' torch threads still fill them once
            common["torch_threads"] = max(1, len(cpus) // workers)
        for i in range(self.up.prefill_workers):
            self._start_worker("prefill", i, common)
        for i in range(self.up.decode_workers):
            self._start_worker("decode", i, common)
        if self.cpu_shares:
            placed = ", ".join(
                f"{c.name}: {','.join(map(str, cs))}"
                for c, cs in zip(self.children, self.cpu_shares, strict=True)
            )
            print(f"pdserve: worker CPUs ({placed})", flush=True)
        env = service_env({**common, **_values(self.gateway)})
        self.children.append(spawn("gateway", service_argv("gateway"), env))

    def _start_cluster(self) -> NatsCluster:
        if self.up.nats_cluster > 9:
            raise SystemExit("pdserve up: --nats-cluster takes 1 to 9 nodes")
        workdir = Path(tempfile.mkdtemp(prefix="pdserve-nats-cluster-"))
        cluster = NatsCluster.local(
            self.up.nats_cluster,
            workdir,
            max_payload=self.bus.max_message_bytes,
            token=self.bus.nats_token,
            user=self.bus.nats_user,
            password=self.bus.nats_password,
        )
        cluster.start()
        return cluster

    def _start_worker(self, role: str, index: int, common: dict[str, object]) -> None:
        worker = dataclasses.replace(self.worker)
        worker.worker_id = f"{self.worker.worker_id or role}-{index}"
        if worker.metrics_port:
            offset = index + (self.up.prefill_workers if role == "decode" else 0)
            worker.metrics_port += offset
        if worker.ucx_port:
            worker.ucx_port += index + (self.up.prefill_workers if role == "decode" else 0)
        slot = index + (self.up.prefill_workers if role == "decode" else 0)
        if self.nats_cluster is not None:  # spread the workers over the nodes, each its own first
            common = {**common, "nats_url": self.nats_cluster.client_url(slot)}
        env = service_env({**common, **_values(worker)})
        gpu = gpu_for_worker(slot, self.gpus)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cpus = self.cpu_shares[slot] if self.cpu_shares else None
        self.children.append(spawn(worker.worker_id, service_argv(role), env, cpus=cpus))

    def wait_ready(self) -> bool:
        """Ready = /health is 200 and every worker is in the gateway's registry (/health alone
        needs just one decode worker; requests would otherwise run aggregated until the
        prefill workers have loaded)."""
        base = f"http://{self._http_host()}:{self.gateway.port}"
        expected = self.up.prefill_workers + self.up.decode_workers
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.stopping and time.monotonic() < deadline:
            dead = self._dead_child()
            if dead is not None:
                print(f"pdserve: {dead.name} exited with {dead.popen.returncode}", file=sys.stderr)
                return False
            if http_ok(base + "/health", timeout=1.0) and registered_workers(base) >= expected:
                return True
            time.sleep(0.2)
        return False

    def model_banner(self) -> str:
        from pdserve.shared.models.resolve import describe

        dtype = self.engine.dtype
        if dtype == "auto":  # the engine's rule, decided without importing torch here
            gpu = self.engine.device.startswith("cuda") or (
                self.engine.device == "auto" and bool(self.gpus)
            )
            dtype = "bfloat16" if gpu else "float32"
        name = self.engine.served_model_name
        return describe(self.model) + (f", served as {name}" if name else "") + f", in {dtype}"

    def _http_host(self) -> str:
        host = self.gateway.host
        return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    def _dead_child(self) -> Child | None:
        for child in self.children:
            if not child.alive():
                return child
        return None

    def supervise(self) -> int:
        """Block until a signal, or until the gateway dies (workers may die and come back)."""
        reported: set[int] = set()
        while not self.stopping:
            for child in self.children:
                if not child.alive() and child.pid not in reported:
                    reported.add(child.pid)
                    print(
                        f"pdserve: {child.name} exited with {child.popen.returncode}",
                        file=sys.stderr,
                    )
                    if child.name == "gateway":
                        return 1
            if self.nats is not None and self.nats.child and not self.nats.child.alive():
                print("pdserve: nats-server exited", file=sys.stderr)
                return 1
            if self.nats_cluster is not None and self._cluster_lost(reported):
                print("pdserve: every NATS node exited", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0

    def _cluster_lost(self, reported: set[int]) -> bool:
        """Report each NATS node that died, once; True when none is left."""
        assert self.nats_cluster is not None
        alive = 0
        for node in self.nats_cluster.nodes:
            if node.child is None:
                continue
            if node.child.alive():
                alive += 1
            elif node.child.pid not in reported:
                reported.add(node.child.pid)
                code = node.child.popen.returncode
                print(f"pdserve: NATS {node.server_name} exited with {code}", file=sys.stderr)
        return alive == 0

    def nats_banner(self) -> str:
        if self.nats_cluster is not None:
            nodes = self.nats_cluster.nodes
            return f"nats: cluster of {len(nodes)} at {self.nats_cluster.url}, logs in " + str(
                nodes[0].workdir
            )
        if self.nats is not None:
            return f"nats: {self.nats.url}, log {self.nats.log_path}"
        return f"nats: {self.up.nats_url}"

    def stop(self) -> None:
        """Gateway first: it refuses new requests and finishes its streams while the workers
        still serve them. Then the workers drain, NATS last (draining needs it). A second
        signal cuts every wait short."""
        gateways = [c for c in self.children if c.name == "gateway"]
        workers = [c for c in self.children if c.name != "gateway"]
        for group in (gateways, workers):
            for child in group:
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.worker.drain_seconds + STOP_GRACE
            while any(c.alive() for c in group) and time.monotonic() < deadline and not self.force:
                time.sleep(0.05)
            for child in group:
                child.stop(0.0)  # SIGKILL whatever is left, reap the group
        if self.nats is not None:
            self.nats.stop()
        if self.nats_cluster is not None:
            self.nats_cluster.stop()


def run(ns: argparse.Namespace) -> int:
    launcher = Launcher(ns)
    signal.signal(signal.SIGINT, launcher._on_signal)
    signal.signal(signal.SIGTERM, launcher._on_signal)
    rc = 1
    try:
        launcher.start()
        if launcher.wait_ready():
            up = launcher.up
            print(
                f"pdserve ready at http://{launcher._http_host()}:{launcher.gateway.port} "
                f"(prefill workers: {up.prefill_workers}, decode workers: {up.decode_workers}, "
                f"{launcher.nats_banner()})",
                flush=True,
            )
            print(f"pdserve model: {launcher.model_banner()}", flush=True)
            rc = launcher.supervise()
        elif launcher.stopping:
            rc = 0
    finally:
        launcher.stop()
    return rc
