"""``pdserve up``: NATS, prefill workers, decode workers and the gateway on one machine.

Each service runs as its own process (``python -m pdserve.cli <cmd>``) in its own process group,
exactly as compose runs them, so local runs exercise the real wiring. Options reach the children
as ``PDSERVE_*`` environment variables (secrets stay out of ``ps``). Children get SIGTERM from the
kernel if the launcher itself dies (PR_SET_PDEATHSIG), and on Ctrl-C/SIGTERM the launcher stops
the gateway, lets workers drain, then stops NATS: nothing is left behind.

CPUs: with at least as many CPUs as worker ranks (a worker of TP N is N ranks), each worker runs
on a share of its own (``cpu_shares``, sched affinity; a TP-2 worker's share is twice a TP-1
worker's, and its rank 0 splits it between its ranks) and sizes its torch thread pool to that
share, so two workers' GEMMs never preempt each other (on 2 cores, 1P1D: one core each). With
fewer CPUs, the workers share them all and split the thread count between all ranks instead. The
gateway and NATS, light and mostly waiting, float. ``--no-split-cpus`` and ``--torch-threads``
override both.

Tensor parallelism: each role runs at its own TP size (``--prefill-tensor-parallel-size``,
``--decode-tensor-parallel-size``, else ``--tensor-parallel-size``). A size the model's heads or
the GPUs cannot take is refused before anything starts, in one line, instead of N workers failing
to load one after another.

NATS: one private nats-server, or with ``--nats-cluster N`` N nodes routed to each other on
loopback (``local_nats.py``; the gateway prefers node 1). The launcher keeps serving while at
least one node lives.

``--autoscale`` (services/control/autoscale.py) adds workers through ``add_worker`` and drains them.
``pdserve rollout`` (services/control/rollout.py) reaches the launcher over NATS (services/control/channel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time

from pdserve.services.control import autoscale
from pdserve.services.control.launch_checks import (
    metrics_key,
    promised_ports,
    registered_workers,
    tp_refusal,
)
from pdserve.services.control.local_nats import LocalNats
from pdserve.services.control.processes import (
    Child,
    gpu_for_worker,
    http_ok,
    spawn,
    visible_gpus,
)
from pdserve.services.control.rollout import RolloutDriver
from pdserve.services.control.warm_pool import WarmPool
from pdserve.services.engine.model_config import ModelConfig
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig, UpConfig, WorkerConfig
from pdserve.shared.cpus import cpu_shares
from pdserve.shared.errors import StartupError
from pdserve.shared.options import build, option_values, service_env

READY_TIMEOUT = 600.0  # loading a large model can take minutes
STOP_GRACE = 5.0  # beyond the drain time, before SIGKILL


def service_argv(command: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", command]


class Launcher:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.up = build(UpConfig, ns)
        self.gateway = build(GatewayConfig, ns)
        if self.gateway.response_store_replicas == 0 and self.up.nats_url is None:
            # Stored responses outlive a node of the cluster started here (a quorum of 3 at most).
            replicas = min(self.up.nats_cluster, 3)
            self.gateway = dataclasses.replace(self.gateway, response_store_replicas=replicas)
        self.metrics_key = metrics_key(self.gateway)  # for its own reads of /metrics
        self.engine = build(EngineConfig, ns)
        self.worker = build(WorkerConfig, ns)
        self.bus = build(BusConfig, {**vars(ns), "nats_url": self.up.nats_url or "unset"})
        self.nats = LocalNats(self.up, self.bus)
        self.model = None  # model_resolve.ResolvedModel, set by start()
        self.gpus: list[str] = []
        self.children: list[Child] = []
        self.cpu_shares: list[list[int]] | None = None  # per worker, in start order
        self.tps = {
            role: self.up.role_tensor_parallel_size(role, self.engine.tensor_parallel_size)
            for role in ("prefill", "decode")
        }
        self.stopping = False
        self.force = False
        # start order: a worker's slot (ports, NATS node) and first rank (UCX ports, GPUs)
        self.slots, self.ranks = 0, 0
        self.next_index = {"prefill": 0, "decode": 0}
        self.common: dict[str, object] = {}  # every worker's options, for later starts too
        self.started: dict[str, autoscale.WorkerStart] = {}  # worker id -> role, place, time
        # --autoscale's flags are refused here, before anything starts
        self.autoscale = autoscale.settings(self.up) if self.up.autoscale else None
        if self.engine.prompt_deadline_ms < 0:  # auto: the TTFT target the planner sizes for
            deadline = self.up.slo_ttft_ms if self.up.autoscale else 0.0
            self.engine = dataclasses.replace(self.engine, prompt_deadline_ms=deadline)
        WarmPool.from_flags(self.up)  # a warm pool without --autoscale is refused too
        self.autoscaler: autoscale.Autoscaler | None = None
        self.control: RolloutDriver | None = None  # pdserve rollout's requests (services/rollout)

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
        self.gpus = visible_gpus() if self.engine.device == "auto" else []
        self._check_tensor_parallel()
        counts = self._worker_counts()
        avoid = promised_ports(
            self.up,
            self.gateway,
            self.worker,
            sum(counts.values()),
            sum(self.tps[role] * n for role, n in counts.items()),
        )
        url = self.nats.start(avoid)
        # the launcher (its control channel, rollouts) speaks as control; each child as its role
        self.bus = dataclasses.replace(self.bus, nats_url=url, **self.nats.credentials("control"))
        common = option_values(self.bus, self.engine)
        threads = self._plan_cpus(sorted(os.sched_getaffinity(0)))
        if threads is not None:
            common["torch_threads"] = threads
        self.common = common
        if self.autoscale is not None:  # its budget and port are checked before workers start
            self.autoscaler = autoscale.Autoscaler(self, self.autoscale, self._http_host())
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
        if self.autoscaler is not None:  # the warm pool loads beside the starting fleet
            self.autoscaler.refill()
        gateway = {**common, **self.nats.credentials("gateway"), **option_values(self.gateway)}
        self.children.append(spawn("gateway", service_argv("gateway"), service_env(gateway)))

    def _check_tensor_parallel(self) -> None:
        """Refuse a TP size the model or the GPUs cannot take, before any process starts."""
        if all(self.tps[role] == 1 for role, n in self._worker_counts().items() if n):
            return  # TP 1 fits every model: no need to read its config
        assert self.model is not None
        config = ModelConfig.from_dir(self.model.path)
        devices = None  # CPU ranks (gloo): as many as there are heads to split
        if self.engine.device.startswith("cuda"):
            devices = len(visible_gpus()) or None  # none found: leave it to CUDA to say
        elif self.gpus:
            devices = len(self.gpus)
        problem = tp_refusal(self.up, self.engine, config.num_heads, config.num_kv_heads, devices)
        if problem is not None:
            raise StartupError(problem)

    def _plan_cpus(self, cpus: list[int]) -> int | None:
        """Give each worker its share of ``cpus`` (``self.cpu_shares``), weighed by its ranks.
        Returns the torch threads of every rank where they share all CPUs instead (None: each
        sizes its pool to its own share, or to --torch-threads)."""
        ranks = [self.tps[role] for role, n in self._worker_counts().items() for _ in range(n)]
        self.cpu_shares = cpu_shares(cpus, ranks) if self.up.split_cpus else None
        if self.cpu_shares is not None or self.engine.torch_threads or not ranks:
            return None
        return max(1, len(cpus) // sum(ranks))  # together, all ranks' threads fill them once

    def _worker_counts(self) -> dict[str, int]:
        return {"prefill": self.up.prefill_workers, "decode": self.up.decode_workers}

    def workers_banner(self) -> str:
        """``prefill workers: 1 (TP 2), decode workers: 2``: the TP only where it is not 1."""
        return ", ".join(
            f"{role} workers: {n}" + (f" (TP {self.tps[role]})" if self.tps[role] > 1 else "")
            for role, n in self._worker_counts().items()
        )

    def add_worker(self, role: str, place: autoscale.Placement, standby: bool = False) -> Child:
        """One more worker of ``role`` (the autoscaler's), placed where it says; ``standby``:
        loaded and registered but not routed until promoted (services/standby.py)."""
        return self._start_worker(role, self.next_index[role], self.common, place, standby)

    def _start_worker(
        self,
        role: str,
        index: int,
        common: dict[str, object],
        place: autoscale.Placement | None = None,
        standby: bool = False,
        version: str | None = None,
    ) -> Child:
        # slot: the worker's place in start order (prefill first); first_rank: its first rank's
        tp, slot, first_rank = self.tps[role], self.slots, self.ranks
        self.slots, self.ranks = slot + 1, first_rank + tp
        self.next_index[role] = max(self.next_index[role], index + 1)
        worker = dataclasses.replace(self.worker)
        worker.worker_id = f"{self.worker.worker_id or role}-{index}"
        worker.standby = standby
        if version:  # the engine option: part of the KV layout fingerprint
            common = {**common, "model_version": version}
        if worker.metrics_port:
            worker.metrics_port += slot
        if worker.ucx_port:  # room for a port per rank: the next worker's ports start past them
            worker.ucx_port += first_rank
        nats_url = self.nats.client_url(slot)
        if nats_url is not None:  # spread the workers over a cluster's nodes
            common = {**common, "nats_url": nats_url}
        common = {**common, **self.nats.credentials(role)}
        if common.get("kv_offload_disk"):  # a directory each: a disk tier evicts what it indexed
            common = {
                **common,
                "kv_offload_disk": f"{common['kv_offload_disk']}/{worker.worker_id}",
            }
        env = service_env({**common, **option_values(worker), "tensor_parallel_size": tp})
        if place is None:  # the starting fleet: by start order
            cpus = self.cpu_shares[slot] if self.cpu_shares else None
            place = autoscale.Placement(cpus, gpu_for_worker(first_rank, self.gpus, tp))
        if place.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = place.gpu
        child = spawn(worker.worker_id, service_argv(role), env, cpus=place.cpus)
        self.children.append(child)
        self.started[worker.worker_id] = autoscale.WorkerStart(role, place, time.monotonic())
        return child

    def wait_ready(self) -> bool:
        """Ready = /health is 200 and every worker is in the gateway's registry (/health alone
        needs just one decode worker; requests would otherwise run aggregated until the
        prefill workers have loaded)."""
        base = f"http://{self._http_host()}:{self.gateway.port}"
        expected = self.up.prefill_workers + self.up.decode_workers
        expected += self.autoscaler.pool.size() if self.autoscaler is not None else 0
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.stopping and time.monotonic() < deadline:
            dead = self._dead_child()
            if dead is not None:
                print(f"pdserve: {dead.name} exited with {dead.popen.returncode}", file=sys.stderr)
                return False
            if (
                http_ok(base + "/health", timeout=1.0)
                and registered_workers(base, self.metrics_key) >= expected
            ):
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
            if self.autoscaler is not None:
                self.autoscaler.poll()
            if self.control is not None:
                self.control.poll()
            for child in self.children:
                if not child.alive() and child.pid not in reported:
                    reported.add(child.pid)
                    if self.autoscaler is not None and self.autoscaler.retired(child):
                        continue  # drained on purpose: poll() reaps it
                    if self.control is not None and self.control.retired(child):
                        continue  # replaced by a rollout
                    print(
                        f"pdserve: {child.name} exited with {child.popen.returncode}",
                        file=sys.stderr,
                    )
                    if child.name == "gateway":
                        return 1
            lost = self.nats.lost(reported)
            if lost is not None:
                print(f"pdserve: {lost}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0

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
        self.nats.stop()


def run(ns: argparse.Namespace) -> int:
    launcher = Launcher(ns)
    signal.signal(signal.SIGINT, launcher._on_signal)
    signal.signal(signal.SIGTERM, launcher._on_signal)
    rc = 1
    try:
        launcher.start()
        if launcher.wait_ready():
            print(
                f"pdserve ready at http://{launcher._http_host()}:{launcher.gateway.port} "
                f"({launcher.workers_banner()}, {launcher.nats.banner()})",
                flush=True,
            )
            print(f"pdserve model: {launcher.model_banner()}", flush=True)
            url = f"http://{launcher._http_host()}:{launcher.gateway.port}"
            if launcher.autoscaler is not None:
                launcher.autoscaler.begin(url)
            launcher.control = RolloutDriver(launcher, url)
            launcher.control.start()
            rc = launcher.supervise()
        elif launcher.stopping:
            rc = 0
    finally:
        if launcher.autoscaler is not None:
            launcher.autoscaler.close()
        if launcher.control is not None:
            launcher.control.close()
        launcher.stop()
    return rc
