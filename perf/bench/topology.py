"""Starting a pdserve topology as local processes, each pinned with `taskset`, and reading
what its workers did from their Prometheus pages.

A worker is pinned to cores of its own (standing in for a GPU each); NATS and the gateway share
separate "frontend" cores. `plan_side` turns a `Side` into process specs, `RunningSide` starts
and stops them, `scrape_engine` reads the workers' counters, `Profiler` runs py-spy on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.services.control.bench.client import discover_model
from pdserve.services.control.launcher import service_argv
from pdserve.services.control.processes import Child, NatsServer, free_port, spawn
from pdserve.shared.options import service_env

READY_TIMEOUT = 600.0


@dataclass
class Side:
    """One system under test: a topology to start, or an endpoint that already runs."""

    name: str
    prefill_workers: int = 0
    decode_workers: int = 1
    options: dict[str, object] = field(default_factory=dict)  # pdserve options for every service
    base_url: str | None = None  # external endpoint: nothing is started

    def __post_init__(self) -> None:
        # A misspelt option would travel as an env var nobody reads, and silently compare a
        # setup against itself.
        from pdserve.shared.config import all_option_names

        unknown = sorted(set(self.options) - set(all_option_names()))
        if unknown:
            raise ValueError(f"side {self.name!r}: unknown pdserve options {unknown}")

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers


# -- placement ---------------------------------------------------------------------------------


@dataclass
class ProcSpec:
    """One process of a topology as it will be started."""

    name: str
    role: str  # "nats", "gateway", "prefill", "decode" or "up"
    cores: list[int]
    argv: list[str] = field(default_factory=list)
    options: dict[str, object] = field(default_factory=dict)  # PDSERVE_* values
    env: dict[str, str] = field(default_factory=dict)  # other variables (threads, devices)

    def command_line(self) -> str:
        env = {**self.env, **service_env(self.options, base={})}
        return " ".join(
            [*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, self.argv)]
        )


def cpu_list(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


def parse_cpu_list(text: str) -> list[int]:
    """`0,2-4` -> [0, 2, 3, 4] (taskset's list syntax)."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ValueError(f"empty cpu list {text!r}")
    return cores


def thread_env(cores: int, device: str | None) -> dict[str, str]:
    env = {
        # one compute thread per pinned core: more threads than cores only contend
        "OMP_NUM_THREADS": str(cores),
        "MKL_NUM_THREADS": str(cores),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


def plan_side(
    side: Side,
    worker_cores: Sequence[Sequence[int]],
    frontend_cores: Sequence[int],
    port: int,
    nats_port: int,
    devices: Sequence[str] | None,
    mode: str,
) -> list[ProcSpec]:
    """The processes of one side, each with its cores, options and environment."""
    if len(worker_cores) < side.num_workers:
        raise ValueError(f"{side.name}: {side.num_workers} workers but {len(worker_cores)} slots")
    taskset = ["taskset", "-c"]
    common = {**side.options, "nats_url": f"nats://127.0.0.1:{nats_port}"}
    if mode == "up":
        # `pdserve up` starts every service itself: the whole tree shares one core set
        cores = sorted({c for cs in worker_cores[: side.num_workers] for c in cs})
        cores = sorted(set(cores) | set(frontend_cores))
        argv = [*taskset, cpu_list(cores), *service_argv("up")]
        argv += ["--prefill-workers", str(side.prefill_workers)]
        argv += ["--decode-workers", str(side.decode_workers), "--port", str(port)]
        # no nats_url here: `up` would take it as "use that server" and start none
        # workers get metrics ports base, base+1, ... (prefill first), as `up` numbers them
        opts = {**side.options, "metrics_port": free_port()}
        per_worker = max(1, len(cores) // max(1, side.num_workers))
        return [ProcSpec("up", "up", cores, argv, opts, thread_env(per_worker, None))]
    specs = [ProcSpec("nats", "nats", list(frontend_cores), options={"port": nats_port})]
    roles = ["prefill"] * side.prefill_workers + ["decode"] * side.decode_workers
    counts = {"prefill": 0, "decode": 0}
    for i, role in enumerate(roles):
        cores = list(worker_cores[i])
        worker_id = f"{role}-{counts[role]}"
        counts[role] += 1
        device = devices[i % len(devices)] if devices else None
        specs.append(
            ProcSpec(
                worker_id,
                role,
                cores,
                [*taskset, cpu_list(cores), *service_argv(role)],
                # a /metrics port of its own, so the harness can read the engine's step times
                {**common, "worker_id": worker_id, "metrics_port": free_port()},
                thread_env(len(cores), device),
            )
        )
    gateway_opts = {**common, "port": port, "host": "127.0.0.1"}
    specs.append(
        ProcSpec(
            "gateway",
            "gateway",
            list(frontend_cores),
            [*taskset, cpu_list(frontend_cores), *service_argv("gateway")],
            gateway_opts,
            thread_env(len(frontend_cores), None),
        )
    )
    return specs


def allocate_worker_cores(first: int, per_worker: int, workers: int) -> list[list[int]]:
    return [
        list(range(first + i * per_worker, first + (i + 1) * per_worker)) for i in range(workers)
    ]


# -- running a topology ------------------------------------------------------------------------


def _pin_all_threads(pid: int, cores: Sequence[int]) -> None:
    # nats-server is started by the launcher helper without taskset; -a pins its threads too
    subprocess.run(
        ["taskset", "-a", "-p", "-c", cpu_list(cores), str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _log_tail(child: Child, chars: int = 3000) -> str:
    if child.log_path is None or not child.log_path.exists():
        return ""
    return child.log_path.read_text(errors="replace")[-chars:]


def _probe_completion(base_url: str, timeout: float = 30.0) -> bool:
    """One tiny completion: the gateway is healthy before any worker has registered."""
    body = json.dumps(
        {"model": _model_or_default(base_url), "prompt": [65, 66, 67], "max_tokens": 1}
    ).encode()
    req = urllib.request.Request(
        base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def registered_workers(base_url: str) -> dict[str, int]:
    """Workers the gateway's registry holds, by role, from its re-exported load gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_kv_cache_total_blocks":
            for sample in family.samples:
                role = sample.labels.get("role", "")
                counts[role] = counts.get(role, 0) + 1
    return counts


def _model_or_default(base_url: str) -> str:
    try:
        return asyncio.run(discover_model(base_url, timeout=5))
    except Exception:  # noqa: BLE001 - any failure just means "not ready yet"
        return "default"


class RunningSide:
    """A started topology; `stop()` takes it down gateway first, workers drained, NATS last."""

    def __init__(self, side: Side, specs: list[ProcSpec], log_dir: Path, port: int) -> None:
        self.side = side
        self.specs = specs
        self.log_dir = log_dir
        self.base_url = f"http://127.0.0.1:{port}"
        self.nats: NatsServer | None = None
        self.children: list[Child] = []

    @property
    def metrics_urls(self) -> list[str]:
        ports = []
        for spec in self.specs:
            port = int(str(spec.options.get("metrics_port") or 0))
            if port and spec.role in ("prefill", "decode"):
                ports.append(port)
            elif port and spec.role == "up":
                ports.extend(port + i for i in range(self.side.num_workers))
        return [f"http://127.0.0.1:{port}/metrics" for port in ports]

    def start(self, timeout: float = READY_TIMEOUT) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        for spec in self.specs:
            if spec.role == "nats":
                port = int(str(spec.options["port"]))
                self.nats = NatsServer(
                    port=port, log_path=self.log_dir / "nats.log", workdir=self.log_dir
                )
                self.nats.start()
                assert self.nats.child is not None
                _pin_all_threads(self.nats.child.pid, spec.cores)
                continue
            env = service_env(spec.options, {**clean, **spec.env})
            log = self.log_dir / f"{spec.name}.log"
            self.children.append(spawn(spec.name, spec.argv, env, log))
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for child in self.children:
                if not child.alive():
                    raise RuntimeError(
                        f"{self.side.name}: {child.name} exited with {child.popen.returncode}\n"
                        f"{_log_tail(child)}"
                    )
            # every worker registered, or a disaggregated side could start out aggregated
            # (the gateway prefills locally while no prefill worker is known)
            workers = registered_workers(self.base_url)
            complete = (
                workers.get("prefill", 0) >= self.side.prefill_workers
                and workers.get("decode", 0) >= self.side.decode_workers
            )
            if complete and _probe_completion(self.base_url):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.side.name} not serving after {timeout:.0f}s")
            time.sleep(0.5)

    def stop(self, drain: float = 10.0) -> None:
        gateways = [c for c in self.children if c.name in ("gateway", "up")]
        workers = [c for c in self.children if c not in gateways]
        for child in gateways:
            child.stop(drain + 5.0)
        for child in workers:
            child.signal(signal.SIGTERM)  # all at once: they drain in parallel
        for child in workers:
            child.stop(drain)
        if self.nats is not None:
            self.nats.stop()


@contextlib.contextmanager
def running(sides: list[RunningSide]) -> Iterator[list[RunningSide]]:
    started: list[RunningSide] = []
    try:
        for side in sides:
            print(f"starting {side.side.name} ...", flush=True)
            started.append(side)
            side.start()
            print(f"{side.side.name} serving at {side.base_url}", flush=True)
        yield sides
    finally:
        for side in reversed(started):
            side.stop()


class Profiler:
    """py-spy on every Python service of a side for exactly one measured run.

    Sampling is non-blocking (the process is never paused), so the profile costs the server a
    little CPU but no latency spikes. Flame graphs land in <run folder>/profiles/.
    """

    def __init__(self, binary: str, out_dir: Path, fmt: str = "flamegraph", rate: int = 100):
        self.binary, self.out_dir, self.fmt, self.rate = binary, out_dir, fmt, rate
        self.active: list[subprocess.Popen] = []
        self.files: list[Path] = []

    @staticmethod
    def find(explicit: str | None) -> str:
        for candidate in (explicit, str(Path(sys.executable).parent / "py-spy")):
            if candidate and Path(candidate).exists():
                return candidate
        found = shutil.which("py-spy")
        if found is None:
            raise SystemExit("--py-spy needs py-spy: pip install py-spy, or pass --py-spy-bin")
        return found

    def start(self, runner: RunningSide, label: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        ext = {"flamegraph": "svg", "speedscope": "json", "raw": "txt"}[self.fmt]
        for child in runner.children:
            out = self.out_dir / f"{slug(runner.side.name)}-{slug(label)}-{child.name}.{ext}"
            argv = [self.binary, "record", "--nonblocking", "--rate", str(self.rate)]
            argv += ["--format", self.fmt, "--output", str(out), "--pid", str(child.pid)]
            if child.name == "up":
                argv.append("--subprocesses")  # the services are the launcher's children
            log = open(self.out_dir / "py-spy.log", "ab")  # noqa: SIM115 - the child owns it
            self.active.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            self.files.append(out)

    def stop(self) -> None:
        # SIGINT makes py-spy write what it sampled and exit
        for proc in self.active:
            proc.send_signal(signal.SIGINT)
        for proc in self.active:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.active.clear()


# -- what the workers did ----------------------------------------------------------------------

DECODE_STEP = "pdserve_worker_decode_step_seconds"
PREFILL_TIME = "pdserve_worker_prefill_time_seconds"


@dataclass
class EngineCounters:
    """Cumulative counters of a side's workers, read from their /metrics pages."""

    decode_step_seconds: float = 0.0
    decode_steps: float = 0.0
    remote_prefills: float = 0.0  # prompts prefilled by prefill workers (not locally)


def scrape_engine(urls: Sequence[str]) -> EngineCounters:
    from prometheus_client.parser import text_string_to_metric_families

    c = EngineCounters()
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue  # a worker that is gone adds nothing; the run's own numbers will show it
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == DECODE_STEP + "_sum":
                    c.decode_step_seconds += sample.value
                elif sample.name == DECODE_STEP + "_count":
                    c.decode_steps += sample.value
                elif sample.name == PREFILL_TIME + "_count" and sample.labels.get("role") == (
                    "prefill"
                ):
                    c.remote_prefills += sample.value
    return c


@dataclass
class EngineSteps:
    """What the workers did during one measured run."""

    steps: int
    mean_ms: float
    remote_prefills: int = 0
    warning: str = ""

    @classmethod
    def between(cls, before: EngineCounters, after: EngineCounters) -> EngineSteps:
        steps = int(after.decode_steps - before.decode_steps)
        seconds = after.decode_step_seconds - before.decode_step_seconds
        remote = int(after.remote_prefills - before.remote_prefills)
        return cls(steps, 1000.0 * seconds / steps if steps else 0.0, remote)


def machine_description() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    desc: dict[str, Any] = {
        "host_cpus": os.cpu_count(),
        "usable_cpus": sorted(os.sched_getaffinity(0)),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError, ValueError):
        kb = next(
            int(x.split()[1])
            for x in Path("/proc/meminfo").read_text().splitlines()
            if x.startswith("MemTotal")
        )
        desc["memory_gib"] = round(kb / 2**20, 1)
    with contextlib.suppress(Exception):
        # versions from package metadata: importing torch here would cost seconds
        from importlib.metadata import version

        desc["torch"] = version("torch")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        if gpus.returncode == 0:
            desc["gpus"] = gpus.stdout.strip().splitlines()
    return desc


def slug(name: str) -> str:
    """A file-name-safe form of a side or run name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
