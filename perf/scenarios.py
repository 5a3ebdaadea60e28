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
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.services.control.bench.cli import describe, make_parser
from pdserve.services.control.bench.client import ClientConfig, discover_model, warm_up
from pdserve.services.control.bench.metrics import compute_metrics, parse_goodput
from pdserve.services.control.bench.report import write_outputs
from pdserve.services.control.bench.results import RunResult, jsonable
from pdserve.services.control.bench.sweep import (
    CALIBRATION_SEED_OFFSET,
    WARMUP_SEED_OFFSET,
    build_dataset,
    client_config,
    measure_rate,
    print_summary,
)
from pdserve.services.control.processes import find_nats_server, free_port
from perf.bench.compare import Targets, scenario_report
from perf.bench.topology import (
    EngineSteps,
    Profiler,
    RunningSide,
    Side,
    allocate_worker_cores,
    machine_description,
    parse_cpu_list,
    plan_side,
    running,
    scrape_engine,
    slug,
)


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
            Side("prefix cache on", 1, 1, options={"prefix_cache": True}),
            Side("prefix cache off", 1, 1, options={"prefix_cache": False}),
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
        "--client-cores",
        default="auto",
        help="cores for the bench client (auto: the usable cores no service is pinned to; "
        "none: leave it unpinned)",
    )
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
            runners[side.name] = RunningSide(side, specs, out_dir / "logs" / slug(side.name), port)

    # external endpoints run wherever they run: only a topology started here has cores to avoid
    client = client_cores(args.client_cores, slots, frontend) if runners else []
    _print_plan(scenario, sides, list(runners.values()), ns, requests, slots, args)
    print(f"bench client cores: {client or 'unpinned (no core is left over)'}")
    if args.dry_run:
        return _check_plan(list(runners.values()), slots, frontend)
    _check_plan(list(runners.values()), slots, frontend, strict=True)
    affinity = os.sched_getaffinity(0)
    if client:
        # the client on cores of its own: sharing a worker's core would slow the server down
        # and delay the client's own timestamps
        os.sched_setaffinity(0, client)
    try:
        return _run(args, ns, scenario, sides, runners, requests, user_rates, out_dir)
    finally:
        os.sched_setaffinity(0, affinity)  # the next scenario of `all` plans from the full set


def _run(
    args: argparse.Namespace,
    ns: argparse.Namespace,
    scenario: Scenario,
    sides: list[Side],
    runners: dict[str, RunningSide],
    requests: list[Any],
    user_rates: bool,
    out_dir: Path,
) -> int:
    """Measure every side, then write the comparison and the bench outputs."""

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
    (out_dir / "comparison.json").write_text(json.dumps(jsonable(summary), indent=1) + "\n")
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
                # ABBA order: neither side always goes first into a machine that drifts
                for side in sides if i % 2 == 0 else reversed(sides):
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


def client_cores(spec: str, slots: Sequence[Sequence[int]], frontend: Sequence[int]) -> list[int]:
    """Cores for the bench client: given, or every usable core no service is pinned to."""
    if spec == "none":
        return []
    if spec != "auto":
        return parse_cpu_list(spec)
    taken = {c for cores in slots for c in cores} | set(frontend)
    return sorted(set(os.sched_getaffinity(0)) - taken)


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
