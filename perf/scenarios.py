"""Side-by-side serving scenarios: start pdserve topologies, load each, compare.

    python -m perf.scenarios disagg-vs-agg [--dry-run] [harness options] [-- bench options]

Each side of a scenario is a pdserve topology started here as local processes, every worker
pinned with `taskset` to cores of its own (standing in for a GPU each), all sides getting the
same number of worker cores. NATS and the gateway share separate "frontend" cores so they do not
steal cycles from the engines. All sides get the same workload (same seed, same token ids) and
the same request-rate sweep in one run; with --interleave (default) every side stays up on the
same cores and rates alternate between sides, so machine noise hits them alike.

Results go to perf/results/<scenario>-<time>/: the bench JSON, markdown and plots with one
series per side, comparison.md with the ratios against the scenario's targets, and each
process's log under logs/.

`--external NAME=URL` benchmarks endpoints that are already running instead of starting any.
With real models on GPUs, pass --no-interleave so only one side holds the weights at a time.

Scenarios: disagg-vs-agg (1P1D against 2 decode workers prefilling locally, chat traffic with
20% long prompts: p99 TTFT/TPOT and goodput side by side), prefix-cache (cache on/off on a
shared-prefix workload), token-overhead (TPOT through HTTP minus the engine's own decode step),
or all of them. Goodput SLOs default to multiples of an unloaded calibration run and the rate
sweep to multiples of its serial capacity, so one command fits any machine; --goodput and
--request-rate after `--` fix them instead. Every run also reads the workers' Prometheus
counters: decode steps and their mean time, and how many prompts prefill workers prefilled
(a disaggregated side that silently fell back to local prefill is flagged).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import math
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

import numpy as np

from perf.bench.client import ClientConfig, discover_model, warm_up
from perf.bench.metrics import compute_metrics, max_goodput_rate, parse_goodput
from perf.bench.report import RunResult, write_outputs
from perf.bench_cli import (
    CALIBRATION_SEED_OFFSET,
    WARMUP_SEED_OFFSET,
    build_dataset,
    client_config,
    describe,
    make_parser,
    measure_rate,
    print_summary,
)
from services.launcher import (
    Child,
    NatsServer,
    find_nats_server,
    free_port,
    service_argv,
    service_env,
    spawn,
)

READY_TIMEOUT = 600.0


@dataclass
class Side:
    """One system under test: a topology to start, or an endpoint that already runs."""

    name: str
    prefill_workers: int = 0
    decode_workers: int = 1
    options: dict[str, object] = field(default_factory=dict)  # pdserve options for every service
    base_url: str | None = None  # external endpoint: nothing is started

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers


@dataclass
class Targets:
    """What the candidate must achieve against the baseline (ratios candidate / baseline)."""

    max_p99_tpot_ratio: float | None = None
    min_goodput_ratio: float | None = None
    max_token_overhead_ms: float | None = None  # TPOT p50 through HTTP minus engine step time


@dataclass
class Scenario:
    name: str
    description: str
    sides: list[Side]
    bench_defaults: list[str]
    baseline: str | None = None
    candidate: str | None = None
    targets: Targets = field(default_factory=Targets)
    calibrate_slos: bool = True  # derive goodput SLOs from unloaded latency unless given


SCENARIOS: dict[str, Scenario] = {
    "disagg-vs-agg": Scenario(
        name="disagg-vs-agg",
        description=(
            "Disaggregated 1P1D against aggregated (decode workers prefilling locally) with equal "
            "worker cores; chat-like traffic where 20% of requests carry 2-4k-token prompts."
        ),
        sides=[
            Side("disaggregated 1P1D", prefill_workers=1, decode_workers=1),
            # with no prefill worker alive the gateway sends every request straight to a
            # decode worker, which prefills it locally
            Side("aggregated 2D", prefill_workers=0, decode_workers=2),
        ],
        bench_defaults=[
            *("--dataset", "chat", "--input-len", "256", "--output-len", "128"),
            *("--max-input-len", "1536", "--max-output-len", "512"),
            *("--long-fraction", "0.2", "--long-input-range", "2048:4096"),
            *("--num-requests", "100", "--seed", "0", "--warmup-requests", "4"),
        ],
        baseline="aggregated 2D",
        candidate="disaggregated 1P1D",
        targets=Targets(max_p99_tpot_ratio=0.5, min_goodput_ratio=1.5),
    ),
    "prefix-cache": Scenario(
        name="prefix-cache",
        description=(
            "Disaggregated 1P1D with the prefix cache on against off: many requests share a few "
            "long system prompts, so with the cache on most prefill work is a cache hit."
        ),
        sides=[
            Side("prefix cache on", 1, 1, options={"enable_prefix_cache": True}),
            Side("prefix cache off", 1, 1, options={"enable_prefix_cache": False}),
        ],
        bench_defaults=[
            *("--dataset", "shared-prefix", "--num-prefixes", "4", "--prefix-len", "1536"),
            *("--input-len", "64", "--output-len", "32", "--range-ratio", "0.5"),
            *("--num-requests", "80", "--seed", "0", "--warmup-requests", "2"),
        ],
        baseline="prefix cache off",
        candidate="prefix cache on",
    ),
    "token-overhead": Scenario(
        name="token-overhead",
        description=(
            "Per-token cost of gateway + NATS + SSE streaming: TPOT measured through the HTTP "
            "API minus the decode worker's own engine step time, one request at a time."
        ),
        sides=[Side("aggregated 1D", prefill_workers=0, decode_workers=1)],
        bench_defaults=[
            *("--dataset", "random", "--input-len", "32", "--output-len", "256"),
            *("--num-requests", "20", "--max-concurrency", "1", "--request-rate", "inf"),
            *("--warmup-requests", "2", "--seed", "0"),
        ],
        targets=Targets(max_token_overhead_ms=1.0),
        calibrate_slos=False,
    ),
}


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
            child.signal(15)
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
            out = self.out_dir / f"{_slug(runner.side.name)}-{_slug(label)}-{child.name}.{ext}"
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


# -- measuring ---------------------------------------------------------------------------------

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


def _client_config(ns: argparse.Namespace, base_url: str) -> ClientConfig:
    model = ns.model or asyncio.run(discover_model(base_url, ns.api_key))
    return client_config(ns, base_url, model)


def warm(ns: argparse.Namespace, base_url: str) -> None:
    """Unmeasured requests with prompts of their own, outside every measured window."""
    if ns.warmup_requests > 0:
        reqs = build_dataset(ns, WARMUP_SEED_OFFSET, ns.warmup_requests)
        asyncio.run(warm_up(_client_config(ns, base_url), reqs))


def bench_once(
    ns: argparse.Namespace,
    requests: list[Any],
    base_url: str,
    series: str,
    rate: float,
    slos: dict[str, float],
    max_concurrency: int | None = None,
    seed_offset: int = 0,
) -> RunResult:
    cfg = _client_config(ns, base_url)
    return asyncio.run(
        measure_rate(ns, cfg, requests, rate, slos, series, seed_offset, max_concurrency)
    )


@dataclass
class Calibration:
    """Unloaded latencies (one request at a time) that scale the SLOs and the rate sweep."""

    ttft_p90_ms: float
    tpot_p90_ms: float
    e2el_mean_s: float

    def slos(self, scale_ttft: float, scale_tpot: float) -> dict[str, float]:
        return {"ttft": scale_ttft * self.ttft_p90_ms, "tpot": scale_tpot * self.tpot_p90_ms}

    def rates(self, workers: int, factors: Sequence[float]) -> list[float]:
        # serial capacity of the workers; continuous batching lifts the real one above it
        base = workers / self.e2el_mean_s
        return [round(base * f, 3) for f in factors]


def calibrate(ns: argparse.Namespace, base_url: str, count: int) -> Calibration:
    """DistServe sets SLOs as multiples of the latency a request sees on an idle system."""
    sample = build_dataset(ns, CALIBRATION_SEED_OFFSET, count)
    warm(ns, base_url)
    run = bench_once(ns, sample, base_url, "calibration", math.inf, {}, 1)
    m = compute_metrics(run.records, run.metrics.duration_s, {}, (90.0,))
    if m.completed == 0:
        raise RuntimeError("calibration requests all failed")
    return Calibration(m.ttft_ms.p(90), m.tpot_ms.p(90), m.e2el_ms.mean / 1000.0)


def scenario_report(
    results: list[RunResult],
    scenario: Scenario,
    target_attainment: float,
    workload: str = "",
    engine_steps: dict[str, EngineSteps] | None = None,
) -> tuple[str, dict[str, Any]]:
    """comparison.md and its numbers: candidate/baseline ratios per rate and overall, engine
    step times against the latency seen through HTTP, each checked against the targets."""
    base_name, cand_name = scenario.baseline, scenario.candidate
    series = {r.series for r in results}
    paired = base_name in series and cand_name in series
    title = f"# {scenario.name}" + (f": {cand_name} vs {base_name}" if paired else "")
    lines = [title, "", scenario.description, ""]
    if workload:
        lines += [f"Workload: {workload}.", ""]
    summary: dict[str, Any] = {}
    verdicts: list[str] = []
    t = scenario.targets
    if paired:
        lines += _comparison_section(results, scenario, target_attainment, summary, verdicts)
    if engine_steps:
        lines += _engine_section(results, engine_steps, t, summary, verdicts)
    if verdicts:
        lines += ["", *(f"- {v}" for v in verdicts)]
    return "\n".join(lines) + "\n", summary


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _comparison_section(
    results: list[RunResult],
    scenario: Scenario,
    target_attainment: float,
    summary: dict[str, Any],
    verdicts: list[str],
) -> list[str]:
    base_name, cand_name = scenario.baseline, scenario.candidate
    by = {(r.series, r.request_rate): r for r in results}
    lines = [
        "| rate (req/s) | p99 TTFT base | p99 TTFT cand | ratio | p99 TPOT base | p99 TPOT cand "
        "| ratio | goodput base | goodput cand | ratio | attain. base | attain. cand |",
        "|" + "---|" * 12,
    ]
    rows = []
    for rate in sorted({r.request_rate for r in results}):
        b, c = by.get((base_name, rate)), by.get((cand_name, rate))
        if b is None or c is None:
            continue
        bm, cm = b.metrics, c.metrics
        row = {
            "rate": rate,
            "ttft_p99_ratio": _ratio(cm.ttft_ms.p(99), bm.ttft_ms.p(99)),
            "tpot_p99_ratio": _ratio(cm.tpot_ms.p(99), bm.tpot_ms.p(99)),
            "goodput_ratio": _ratio(cm.request_goodput, bm.request_goodput),
        }
        rows.append(row)
        lines.append(
            f"| {b.rate_label} | {bm.ttft_ms.p(99):.1f} | {cm.ttft_ms.p(99):.1f} | "
            f"{_fmt_ratio(row['ttft_p99_ratio'])} | {bm.tpot_ms.p(99):.2f} | "
            f"{cm.tpot_ms.p(99):.2f} | {_fmt_ratio(row['tpot_p99_ratio'])} | "
            f"{bm.request_goodput:.3f} | {cm.request_goodput:.3f} | "
            f"{_fmt_ratio(row['goodput_ratio'])} | {100 * bm.slo_attainment:.0f}% | "
            f"{100 * cm.slo_attainment:.0f}% |"
        )

    def max_rate(name: str | None) -> float | None:
        pts = [(r.request_rate, r.metrics.slo_attainment) for r in results if r.series == name]
        return max_goodput_rate(pts, target_attainment)

    gb, gc = max_rate(base_name), max_rate(cand_name)
    ratio = _ratio(gc, gb)
    summary.update(
        baseline=base_name,
        candidate=cand_name,
        per_rate=rows,
        distserve_goodput_base=gb,
        distserve_goodput_cand=gc,
        distserve_goodput_ratio=ratio,
    )
    lines += [
        "",
        f"DistServe goodput (highest rate with >= {target_attainment:.0%} SLO attainment, "
        f"tested rates only): {base_name} {gb}, {cand_name} {gc}, ratio {_fmt_ratio(ratio)}",
    ]
    for name, value in ((base_name, gb), (cand_name, gc)):
        if value is None:
            lines.append(
                f"- {name} met the SLOs for {target_attainment:.0%} of requests at no tested "
                "rate: sweep lower rates (--rate-factors) or relax the SLOs to find its goodput."
            )
    t = scenario.targets
    # judge TPOT at the highest rate both sides served, where interference is worst
    if rows and t.max_p99_tpot_ratio is not None:
        r = rows[-1]["tpot_p99_ratio"]
        ok = r is not None and r <= t.max_p99_tpot_ratio
        verdicts.append(
            f"p99 TPOT ratio at the highest rate {_fmt_ratio(r)} "
            f"(target <= {t.max_p99_tpot_ratio}x): {_verdict(ok)}"
        )
        summary["tpot_target_met"] = ok
    if t.min_goodput_ratio is not None:
        ok = ratio is not None and ratio >= t.min_goodput_ratio
        verdicts.append(
            f"goodput ratio {_fmt_ratio(ratio)} (target >= {t.min_goodput_ratio}x): {_verdict(ok)}"
        )
        summary["goodput_target_met"] = ok
    return lines


def _engine_section(
    results: list[RunResult],
    engine_steps: dict[str, EngineSteps],
    t: Targets,
    summary: dict[str, Any],
    verdicts: list[str],
) -> list[str]:
    """What the HTTP path adds per token: TPOT seen by the client minus the engine's step."""
    lines = [
        "",
        "| run | p50 TPOT (HTTP) | p50 ITL (HTTP) | engine decode step mean | overhead per token "
        "| decode steps | prompts prefilled remotely |",
        "|" + "---|" * 7,
    ]
    rows = {}
    for r in results:
        key = f"{r.series} @ {r.rate_label}"
        steps = engine_steps.get(key)
        if steps is None or not steps.steps:
            continue
        # TPOT minus the step time is a per-token cost only when each step decodes this one
        # request; with a batch, a step serves many requests and the difference means nothing
        overhead = r.metrics.tpot_ms.median - steps.mean_ms if r.max_concurrency == 1 else None
        rows[key] = {
            "tpot_p50_ms": r.metrics.tpot_ms.median,
            "itl_p50_ms": r.metrics.itl_ms.median,
            "engine_step_mean_ms": steps.mean_ms,
            "overhead_ms": overhead,
            "decode_steps": steps.steps,
            "remote_prefills": steps.remote_prefills,
        }
        lines.append(
            f"| {key} | {r.metrics.tpot_ms.median:.3f} | {r.metrics.itl_ms.median:.3f} | "
            f"{steps.mean_ms:.3f} | {'n/a' if overhead is None else f'{overhead:.3f}'} | "
            f"{steps.steps} | {steps.remote_prefills} |"
        )
        if steps.warning:
            verdicts.append(f"WARNING: {steps.warning}; this run does not measure what it says")
    lines += [
        "",
        "Overhead = p50 TPOT through the API minus the mean decode step the workers timed "
        "(their Prometheus histogram), shown for runs with one request at a time; "
        "ITL is per SSE chunk, and a chunk may carry several tokens while the detokenizer waits "
        "for a whole UTF-8 character.",
    ]
    summary["engine"] = rows
    overheads = [row["overhead_ms"] for row in rows.values() if row["overhead_ms"] is not None]
    if t.max_token_overhead_ms is not None and overheads:
        worst = max(overheads)
        ok = worst <= t.max_token_overhead_ms
        verdicts.append(
            f"per-token overhead {worst:.3f} ms at p50 (target <= {t.max_token_overhead_ms} ms): "
            f"{_verdict(ok)}"
        )
        summary["overhead_target_met"] = ok
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


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


# -- command line ------------------------------------------------------------------------------


def make_parser_scenarios() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf.scenarios",
        description="Side-by-side pdserve scenarios. Bench options go after `--`.",
    )
    p.add_argument("scenario", choices=[*sorted(SCENARIOS), "all"], help="what to run")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    p.add_argument(
        "--mode",
        choices=("services", "up"),
        default="services",
        help="start each service pinned (services) or one `pdserve up` per side",
    )
    p.add_argument("--cores-per-worker", type=int, default=1)
    p.add_argument(
        "--first-worker-core",
        type=int,
        default=None,
        help="first core for workers (default: right after the frontend cores)",
    )
    p.add_argument("--frontend-cores", default="0", help="cores for NATS and the gateway")
    p.add_argument(
        "--devices", default=None, help="CUDA_VISIBLE_DEVICES per worker, comma separated (cycled)"
    )
    p.add_argument("--port", type=int, default=0, help="first gateway port (default: free ones)")
    p.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="run sides one after another instead of alternating rates",
    )
    p.add_argument(
        "--external",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="benchmark a running endpoint as a side (replaces the scenario's sides)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="pdserve option for every side, e.g. --option num_kv_blocks=512",
    )
    p.add_argument("--calibration-requests", type=int, default=8)
    p.add_argument(
        "--slo-scale-ttft",
        type=float,
        default=4.0,
        help="TTFT SLO = this x unloaded p90 TTFT (unless --goodput is given)",
    )
    p.add_argument(
        "--slo-scale-tpot",
        type=float,
        default=2.0,
        help="TPOT SLO = this x unloaded p90 TPOT (unless --goodput is given)",
    )
    p.add_argument(
        "--rate-factors",
        default="0.5,1,2,4",
        help="sweep rates as multiples of the unloaded serial capacity "
        "(unless --request-rate is given)",
    )
    p.add_argument(
        "--stop-below-attainment",
        type=float,
        default=0.1,
        help="a side whose SLO attainment drops below this skips the higher rates",
    )
    p.add_argument(
        "--refine-steps",
        type=int,
        default=2,
        help="extra runs per side bisecting its goodput knee between tested rates",
    )
    p.add_argument(
        "--py-spy", action="store_true", help="profile every service during each measured run"
    )
    p.add_argument("--py-spy-bin", default=None, help="py-spy executable (default: PATH)")
    p.add_argument(
        "--py-spy-format", choices=("flamegraph", "speedscope", "raw"), default="flamegraph"
    )
    p.add_argument("--results", default="perf/results", help="parent folder of the run folder")
    p.add_argument("--name", default=None, help="run folder name (default: scenario-time)")
    return p


def _sides(args: argparse.Namespace, scenario: Scenario) -> list[Side]:
    if args.external:
        sides = []
        for item in args.external:
            name, sep, url = item.partition("=")
            if not sep or not url.startswith("http"):
                raise SystemExit(f"--external wants NAME=URL, got {item!r}")
            sides.append(Side(name, base_url=url.rstrip("/")))
        return sides
    extra: dict[str, object] = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option wants NAME=VALUE, got {item!r}")
        extra[key.replace("-", "_")] = value
    return [dataclasses.replace(s, options={**s.options, **extra}) for s in scenario.sides]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = make_parser_scenarios().parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    if args.scenario == "all":
        # one after another, each with its own defaults and run folder
        rest = list(argv)
        rest.remove("all")  # the first "all" is the positional one: it precedes any "--"
        return max([main([name, *rest]) for name in SCENARIOS])
    scenario = copy.deepcopy(SCENARIOS[args.scenario])
    ns = make_parser().parse_args([*scenario.bench_defaults, *bench_args])
    ns.percentiles = sorted({*ns.percentiles, 50.0, 90.0, 99.0})  # the comparison reads p99
    user_rates = any(
        a.startswith("--request-rate") for a in [*scenario.bench_defaults, *bench_args]
    )
    sides = _sides(args, scenario)
    if args.external and scenario.baseline not in {s.name for s in sides}:
        # external sides: the last one named is the baseline, the first the candidate
        scenario.baseline, scenario.candidate = sides[-1].name, sides[0].name
    requests = build_dataset(ns)
    name = args.name or f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.results) / name

    frontend = parse_cpu_list(args.frontend_cores)
    first = args.first_worker_core if args.first_worker_core is not None else max(frontend) + 1
    most = max((s.num_workers for s in sides if s.base_url is None), default=0)
    slots = allocate_worker_cores(first, args.cores_per_worker, most)
    devices = args.devices.split(",") if args.devices else None
    runners: dict[str, RunningSide] = {}
    for side in sides:
        if side.base_url is None:
            port = args.port + len(runners) if args.port else free_port()
            specs = plan_side(side, slots, frontend, port, free_port(), devices, args.mode)
            runners[side.name] = RunningSide(side, specs, out_dir / "logs" / _slug(side.name), port)

    _print_plan(scenario, sides, list(runners.values()), ns, requests, slots, args)
    if args.dry_run:
        return _check_plan(list(runners.values()), slots, frontend)
    _check_plan(list(runners.values()), slots, frontend, strict=True)

    config = {
        "scenario": scenario.name,
        "harness": vars(args),
        "bench": describe(ns),
        "machine": machine_description(),
        "sides": [dataclasses.asdict(s) for s in sides],
        "processes": {n: [s.command_line() for s in r.specs] for n, r in runners.items()},
    }
    engine_steps: dict[str, EngineSteps] = {}
    profiler = None
    if args.py_spy:
        profiler = Profiler(
            Profiler.find(args.py_spy_bin), out_dir / "profiles", args.py_spy_format
        )
    results = measure(
        args,
        ns,
        sides,
        runners,
        requests,
        user_rates,
        scenario.calibrate_slos,
        config,
        engine_steps,
        profiler,
    )
    slos = ", ".join(f"{k} <= {v:.1f} ms" for k, v in config["slos_ms"].items()) or "none"
    workload = f"{describe_workload(ns, requests)}; SLOs {slos}"
    md, summary = scenario_report(
        results, scenario, ns.slo_attainment_target, workload, engine_steps
    )
    config["engine_steps"] = {k: dataclasses.asdict(v) for k, v in engine_steps.items()}
    if profiler is not None and profiler.files:
        found = [f for f in profiler.files if f.exists()]
        md += "\n## py-spy profiles (one per service and run)\n\n"
        md += "".join(f"- [{f.name}]({f.relative_to(out_dir)})\n" for f in found)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "comparison.md").write_text(md)
    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=1) + "\n")
    paths = write_outputs(
        results, out_dir, "bench", config, {"comparison": "comparison.md"}, ns.plots, ns.detailed
    )
    print(md)
    print(f"results in {out_dir}: comparison.md, " + ", ".join(p.name for p in paths.values()))
    return 0


def measure(
    args: argparse.Namespace,
    ns: argparse.Namespace,
    sides: list[Side],
    runners: dict[str, RunningSide],
    requests: list[Any],
    user_rates: bool,
    want_slos: bool,
    config: dict[str, Any],
    engine_steps: dict[str, EngineSteps],
    profiler: Profiler | None = None,
) -> list[RunResult]:
    """Every side at every rate: alternating sides per rate, or one side after another."""
    results: list[RunResult] = []
    saturated: set[str] = set()
    warmed: set[str] = set()

    def bench(
        side: Side, url: str, index: int, rate: float, slos: dict[str, float], force: bool = False
    ) -> None:
        if side.name in saturated and not force:
            return
        # the same prompts for every side at this rate, other prompts at other rates
        reqs = requests if index == 0 else build_dataset(ns, seed_offset=index)
        metrics_urls = runners[side.name].metrics_urls if side.name in runners else []
        if side.name not in warmed:
            warm(ns, url)
            warmed.add(side.name)
        before = scrape_engine(metrics_urls)
        if profiler is not None and side.name in runners:
            profiler.start(runners[side.name], f"{rate:g}")
        try:
            result = bench_once(ns, reqs, url, side.name, rate, slos, None, index)
        finally:
            if profiler is not None:
                profiler.stop()
        if metrics_urls:
            steps = EngineSteps.between(before, scrape_engine(metrics_urls))
            # A disaggregated side whose prefill worker is not used (not registered, refused
            # work) silently measures aggregated serving; say so instead of comparing.
            done = result.metrics.completed
            if side.prefill_workers and steps.remote_prefills < 0.9 * done:
                steps.warning = (
                    f"{side.name} @ {result.rate_label}: only {steps.remote_prefills} of {done} "
                    "prompts were prefilled on prefill workers"
                )
                print(f"WARNING: {steps.warning}", flush=True)
            engine_steps[f"{side.name} @ {result.rate_label}"] = steps
            print(
                f"engine: {steps.steps} decode steps, mean {steps.mean_ms:.2f} ms; "
                f"{steps.remote_prefills} remote prefills",
                flush=True,
            )
        print_summary(result)
        results.append(result)
        # Past this point a side only queues: higher rates would take ever longer to show
        # the same collapse, and the goodput knee is already behind us.
        if slos and result.metrics.slo_attainment < args.stop_below_attainment:
            print(
                f"{side.name}: SLO attainment below {args.stop_below_attainment:.0%}, "
                "skipping its higher rates",
                flush=True,
            )
            saturated.add(side.name)

    def url_of(side: Side) -> str:
        return side.base_url or runners[side.name].base_url

    def refine(side: Side, slos: dict[str, float], first_index: int) -> None:
        """Bisect between the highest rate that met the attainment target and the lowest one
        above it that did not, so the DistServe goodput is not just the nearest tested rate."""
        for k in range(args.refine_steps if slos else 0):
            points = [
                (r.request_rate, r.metrics.slo_attainment) for r in results if r.series == side.name
            ]
            rate = next_refine_rate(points, ns.slo_attainment_target)
            if rate is None:
                return  # every tested rate passes: the knee lies above the sweep
            print(f"{side.name}: refining the goodput knee at {rate:g} req/s", flush=True)
            bench(side, url_of(side), first_index + k, rate, slos, force=True)

    if args.interleave:
        with running(list(runners.values())):
            rates, slos = _rates_and_slos(
                args, ns, url_of(sides[-1]), sides, user_rates, want_slos, config
            )
            for i, rate in enumerate(rates):
                for side in sides:
                    bench(side, url_of(side), i, rate, slos)
            for side in sides:
                refine(side, slos, len(rates))
        return results
    plan: tuple[list[float], dict[str, float]] | None = None
    for side in sides:
        with running([runners[side.name]] if side.name in runners else []):
            if plan is None:  # calibrate on whichever side comes up first
                plan = _rates_and_slos(args, ns, url_of(side), sides, user_rates, want_slos, config)
            for i, rate in enumerate(plan[0]):
                bench(side, url_of(side), i, rate, plan[1])
            refine(side, plan[1], len(plan[0]))
    return results


def next_refine_rate(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Midway between the highest rate meeting the attainment target and the lowest failing
    one above it (from 0 if none passes); None when no tested rate fails."""
    finite = [(rate, att) for rate, att in points if math.isfinite(rate)]
    top = max((rate for rate, att in finite if att >= target), default=0.0)
    failing = [rate for rate, att in finite if att < target and rate > top]
    if not failing:
        return None
    return round((top + min(failing)) / 2, 4)


def _rates_and_slos(
    args: argparse.Namespace,
    ns: argparse.Namespace,
    url: str,
    sides: list[Side],
    user_rates: bool,
    want_slos: bool,
    config: dict[str, Any],
) -> tuple[list[float], dict[str, float]]:
    """The sweep's rates and SLOs: as given, or scaled from an unloaded calibration run."""
    slos = parse_goodput(ns.goodput)
    rates = sorted(ns.request_rate) if user_rates else []  # ascending: see stop_below_attainment
    if (want_slos and not slos) or not rates:
        cal = calibrate(ns, url, args.calibration_requests)
        config["calibration"] = dataclasses.asdict(cal)
        if want_slos and not slos:
            slos = cal.slos(args.slo_scale_ttft, args.slo_scale_tpot)
        if not rates:
            workers = max((s.num_workers for s in sides if s.base_url is None), default=1)
            rates = cal.rates(workers, [float(f) for f in args.rate_factors.split(",")])
        print(
            f"calibration on {url}: unloaded p90 TTFT {cal.ttft_p90_ms:.1f} ms, p90 TPOT "
            f"{cal.tpot_p90_ms:.2f} ms, mean E2E {cal.e2el_mean_s:.3f} s -> SLOs (ms) "
            f"{ {k: round(v, 2) for k, v in slos.items()} }, rates {rates}",
            flush=True,
        )
    config["slos_ms"], config["rates"] = slos, rates
    return rates, slos


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def describe_workload(ns: argparse.Namespace, requests: list[Any]) -> str:
    ins = np.array([r.prompt_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    long = f", {(ins >= ns.long_input_range[0]).mean():.0%} long" if ns.long_fraction else ""
    return (
        f"{ns.dataset} dataset, {len(requests)} requests per rate, prompt tokens "
        f"p50 {np.median(ins):.0f} p90 {np.percentile(ins, 90):.0f} max {ins.max()}{long}; "
        f"output tokens p50 {np.median(outs):.0f} max {outs.max()}"
    )


def _print_plan(scenario, sides, runners, ns, requests, slots, args) -> None:
    print(f"scenario {scenario.name}: {scenario.description}")
    print(f"workload: {describe_workload(ns, requests)}")
    print(
        f"worker core slots: {slots}; frontend cores: {args.frontend_cores}; "
        f"interleave: {args.interleave}"
    )
    for side in sides:
        if side.base_url:
            print(f"[{side.name}] external endpoint {side.base_url}")
    for r in runners:
        print(
            f"[{r.side.name}] {r.side.prefill_workers} prefill + {r.side.decode_workers} decode "
            f"workers, gateway {r.base_url}, logs {r.log_dir}"
        )
        for spec in r.specs:
            line = spec.command_line() if spec.argv else f"nats-server (pinned to {spec.cores})"
            print(f"    {spec.name}: {line}")
    goodput = ns.goodput or (
        f"calibrated: ttft x{args.slo_scale_ttft}, tpot x{args.slo_scale_tpot}"
        if scenario.calibrate_slos
        else "none"
    )
    print(f"goodput SLOs: {goodput}; attainment target {ns.slo_attainment_target:.0%}")


def _check_plan(runners, slots, frontend, strict: bool = False) -> int:
    """Missing cores or binaries: warn in a dry run, refuse in a real one."""
    problems = []
    usable = os.sched_getaffinity(0)
    wanted = {c for s in slots for c in s} | set(frontend)
    if runners and not wanted <= usable:
        problems.append(
            f"cores {sorted(wanted - usable)} are not available (have {sorted(usable)})"
        )
    if runners:
        try:
            find_nats_server()
        except FileNotFoundError as exc:
            problems.append(str(exc))
        if subprocess.run(["taskset", "-V"], capture_output=True).returncode != 0:
            problems.append("taskset not found (util-linux)")
    for p in problems:
        print(("error: " if strict else "warning: ") + p, file=sys.stderr)
    if strict and problems:
        raise SystemExit(2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
