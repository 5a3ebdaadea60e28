"""The SLA planner under a load ramp (issue 32): ``pdserve up --autoscale`` against a fixed 1P1D on
a real CPU stack, and the same ramp on the simulated engine at a GPU host's scale.

Workload (CPU): SmolLM2-135M-Instruct (the real default model; its profile was measured on this
VM by ``pdserve plan``: perf/results/plan_profile_smollm2_2cpu.json). Prompts of 128 random token
ids, 32 output tokens (ignore_eos, greedy), streamed ``/v1/completions``. Open-loop Poisson
arrivals (seeded, thinned) whose rate follows ``RateSchedule.ramp``: ``--low`` (0.3) req/s for
the first 10% of ``--duration`` (180 s), up to ``--high`` (1.0) by 40%, held to 60%, down to
``--low`` by 90%. By the profile (``pdserve plan``'s closed form) one prefill worker holds the
TTFT target to ~1 req/s (a prompt takes 462 ms; p90 ~1.8 s at 1.0) and one decode worker to
1.75 req/s (batch 8 at 142 ms): 1P1D just carries the default peak, ``--high 1.6`` asks for a
second prefill worker (and a second decode worker once the observed ITL corrects the profile).
SLO: TTFT <= 2000 ms and per-request mean ITL <= 150 ms at p90. Each request counts as good
when it finished and met both; attainment is the good share of the requests sent, goodput the
good ones per second of the ramp. Both runs see the same arrival times and lengths.

- ``autoscale``: ``pdserve up --autoscale`` from 1P1D, max 2 prefill and 2 decode workers,
  ``--autoscale-max-cpus 4`` (a worker costs its 1-CPU share; 4 on 2 cores makes the extra
  workers share cores: the only way the planner can act here), 5 s windows, 10 s warm-up.
  Its timeline, worker-seconds (serving + draining workers, integrated) and scaling actions are
  read from ``pdserve_planner_*`` on ``--planner-metrics-port`` once a second.
- ``fixed 1P1D``: ``pdserve up`` with its defaults.

``--rounds 2`` runs the arms A B B A and reports each arm's mean too: this VM's speed drifts by
20-30% within minutes, and one pair, autoscale first, saw the same 1P1D fleet score 74.7% under
the planner and 91.6% fixed just after.

Workload (simulated, perf/planner_sim.py): 8 GPUs, ``Profile.synthetic()`` (an H200-like 8B
model, illustrative roofline numbers), ISL 512-1536 / OSL 128-384, 8 -> 80 -> 8 req/s over
900 s, TTFT <= 500 ms and ITL <= 20 ms at p90, 10 s windows, 60 s cold start, 1 s promotion
from the warm pool (floor: one prefill worker), prefill workers serving prompts past the TTFT
target after the on-time ones (``--prompt-deadline-ms``, which ``pdserve up --autoscale`` sets;
``--sim-arrival-order``: not); autoscale vs fixed 1P1D vs the advisor's best P:D for the peak
rate. ``--steepness`` takes the rise and fall faster about the same peak,
``--seeds`` and several ``--steepness`` values sweep (perf/planner_targets.py: one targets row
per run), ``--sawtooth S`` adds a sawtooth 8 <-> 80 req/s turning every S seconds.

    .venv/bin/python -m perf.planner_bench                 # both (about 8 minutes)
    .venv/bin/python -m perf.planner_bench --mode sim      # the simulated half only (seconds)
    .venv/bin/python -m perf.planner_bench --mode sim --seeds 0 1 2 3 4 \
        --steepness 1 1.5 2 --sawtooth 120                 # issue 49's targets (minutes)

Writes perf/results/planner_bench.json, planner_ramp_cpu.png, planner_ramp_sim8gpu.png (and
planner_sawtooth_sim8gpu.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from pdserve.services.control.bench.client import (
    ClientConfig,
    RequestRecord,
    discover_model,
    send_completion,
)
from pdserve.services.control.bench.datasets import BenchRequest
from pdserve.services.control.planner.sim_data import RateSchedule
from pdserve.services.control.processes import free_port
from perf.planner_cpu_score import CPU_SLO, row
from perf.planner_sim import SimSetup, plot_timeline, table
from perf.planner_targets import run_sims
from perf.stack_bench import stop_stack  # Popen.send_signal skips a process already reaped

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
MODEL = "smollm2-135m-instruct"
READY_TIMEOUT = 300.0
ISL, OSL, VOCAB = 128, 32, 49152


def arrivals(schedule: RateSchedule, seed: int) -> np.ndarray:
    """Poisson arrivals whose rate follows the schedule: candidates at the peak rate, each kept
    with probability rate(t) / peak (thinning)."""
    rng = np.random.default_rng(seed)
    n = int(schedule.peak * schedule.duration * 1.5) + 20
    t = np.cumsum(rng.exponential(1.0 / schedule.peak, n))
    t = t[t < schedule.duration]
    keep = rng.random(len(t)) < np.array([schedule.rate(x) for x in t]) / schedule.peak
    return t[keep]


def start_stack(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(UCX_WARN_UNUSED_ENV_VARS="n", TOKENIZERS_PARALLELISM="false")
    env.pop("OMP_NUM_THREADS", None)  # pdserve up sizes its workers' threads itself
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", MODEL, "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*argv, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + READY_TIMEOUT
    while "pdserve ready at" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_stack(proc)
            raise RuntimeError(f"pdserve up did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def _series(text: str, name: str) -> dict[str, float]:
    """role -> value of ``name{role="..."}`` (summed over other labels)."""
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        role = re.search(r'role="(\w+)"', m.group(1))
        if role:
            out[role.group(1)] = out.get(role.group(1), 0.0) + float(m.group(2))
    return out


async def watch(url: str | None, start: float, stop: asyncio.Event) -> list[dict[str, float]]:
    """The planner's gauges once a second (None: a fixed fleet, nothing to read)."""
    rows: list[dict[str, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while url and not stop.is_set():
            try:
                async with session.get(url + "/metrics") as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                text = ""
            cur = _series(text, "pdserve_planner_current_workers")
            if cur:
                drn = _series(text, "pdserve_planner_draining_workers")
                act = _series(text, "pdserve_planner_scaling_actions_total")
                rows.append(
                    {
                        "t": time.perf_counter() - start,
                        "prefill": cur.get("prefill", 0),
                        "decode": cur.get("decode", 0),
                        "draining": sum(drn.values()),
                        "actions": sum(act.values()),
                    }
                )
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    return rows


async def drive(base: str, offsets: np.ndarray, metrics: str | None) -> tuple[list, list]:
    rng = np.random.default_rng(1)
    reqs = [BenchRequest(rng.integers(100, VOCAB, ISL).tolist(), OSL) for _ in offsets]
    cfg = ClientConfig(base, await discover_model(base), timeout=300.0)
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        start = time.perf_counter()
        watcher = asyncio.create_task(watch(metrics, start, stop))

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + float(offsets[i]) - time.perf_counter()))
            return await send_completion(session, cfg, reqs[i], i, start)

        records = await asyncio.gather(*(one(i) for i in range(len(offsets))))
        await asyncio.sleep(3.0)  # a last look at the fleet once the ramp's answers are in
        stop.set()
        timeline = await watcher
    if records and not any(r.success for r in records):
        raise RuntimeError(f"every request failed, e.g. {records[0].error}")
    return list(records), timeline


def _run_arm(
    label: str,
    offsets: np.ndarray,
    profile: Path,
    slo: list[str],
    tmp: Path,
    duration: float,
) -> dict[str, Any]:
    """One run of the ramp on a fresh stack: ``autoscale`` or ``fixed 1P1D``."""
    mport = free_port()
    extra = (
        []
        if label != "autoscale"
        else [
            "--autoscale",
            "--planner-profile",
            str(profile),
            *slo,
            "--max-prefill-workers",
            "2",
            "--max-decode-workers",
            "2",
            "--autoscale-max-cpus",
            "4",
            "--autoscale-interval",
            "5",
            "--planner-warmup-seconds",
            "10",
            "--planner-metrics-port",
            str(mport),
        ]
    )
    log = tmp / f"{label.split()[0]}.log"
    proc, base = start_stack(extra, log)
    try:
        metrics = f"http://127.0.0.1:{mport}" if label == "autoscale" else None
        records, timeline = asyncio.run(drive(base, offsets, metrics))
    finally:
        stop_stack(proc)
    out = row(label, records, timeline, duration, label != "autoscale")
    # the planner's lines, with the reasons it prints indented below a move
    said, keep = [], False
    for ln in log.read_text(errors="replace").splitlines():
        keep = "pdserve autoscale:" in ln or (keep and ln.startswith("  "))
        if keep:
            said.append(ln)
    out["planner_log"] = said[-400:]
    return out


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    schedule = RateSchedule.ramp(args.low, args.high, args.duration)
    offsets = arrivals(schedule, args.seed)
    profile = Path(args.profile).resolve()
    slo = [
        "--slo-ttft-ms",
        str(CPU_SLO.ttft_ms),
        "--slo-itl-ms",
        str(CPU_SLO.itl_ms),
        "--slo-percentile",
        CPU_SLO.percentile,
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # ABBA: each round swaps the arms' order, so that a host whose speed drifts over minutes
        # (20-30% on this VM) favours neither arm on the mean of an even number of rounds
        for round_ in range(args.rounds):
            order = ("autoscale", "fixed 1P1D")[:: 1 if round_ % 2 == 0 else -1]
            for label in order:
                rows.append(_run_arm(label, offsets, profile, slo, Path(tmp), args.duration))
                rows[-1]["round"] = round_
                print(
                    f"round {round_}, {label}: {rows[-1]['attainment']:.1%} good,"
                    f" {rows[-1]['failed']} failed",
                    flush=True,
                )
    means = {
        label: statistics.fmean(r["attainment"] for r in rows if r["config"] == label)
        for label in ("autoscale", "fixed 1P1D")
    }
    return {
        "setup": {
            "model": MODEL,
            "profile": str(profile.relative_to(ROOT)),
            "isl": ISL,
            "osl": OSL,
            "low": args.low,
            "high": args.high,
            "duration_s": args.duration,
            "seed": args.seed,
            "requests": len(offsets),
            "slo": CPU_SLO.describe(),
            "cpus": len(os.sched_getaffinity(0)),
        },
        "schedule": [list(p) for p in schedule.points],
        "rows": rows,
        "mean_attainment": means,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("both", "cpu", "sim"), default="both")
    ap.add_argument("--low", type=float, default=0.3, help="CPU ramp: requests/s at its ends")
    ap.add_argument("--high", type=float, default=1.0, help="CPU ramp: requests/s at its peak")
    ap.add_argument("--duration", type=float, default=180.0, help="CPU ramp length, seconds")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="CPU ramp: runs of each arm, the order swapped every round (2: ABBA)",
    )
    ap.add_argument("--profile", default=str(RESULTS / "plan_profile_smollm2_2cpu.json"))
    ap.add_argument("--sim-profile", default="", help="a Profile JSON (default: synthetic)")
    ap.add_argument("--sim-duration", type=float, default=SimSetup.duration_s)
    ap.add_argument(
        "--sim-window",
        type=float,
        default=SimSetup.window_s,
        help="the simulated planner's interval, seconds",
    )
    ap.add_argument(
        "--sim-warm-prefill",
        type=int,
        default=SimSetup.warm_prefill,
        help="simulated warm pool's floor of prefill workers",
    )
    ap.add_argument("--sim-warm-decode", type=int, default=SimSetup.warm_decode)
    ap.add_argument(
        "--sim-arrival-order",
        action="store_true",
        help="simulated prefill workers in strict arrival order (no --prompt-deadline-ms)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="*",
        default=[],
        help="simulated runs: one ramp per seed (default: --seed)",
    )
    ap.add_argument(
        "--steepness",
        type=float,
        nargs="+",
        default=[1.0],
        help="simulated ramps: rise and fall this many times as fast (>= 1)",
    )
    ap.add_argument(
        "--sawtooth",
        type=float,
        default=0.0,
        help="also a simulated sawtooth low <-> high turning every this many s",
    )
    ap.add_argument("--sawtooth-duration", type=float, default=1200.0)
    ap.add_argument("--json", default=str(RESULTS / "planner_bench.json"))
    ap.add_argument("--plot-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if min(args.steepness) < 1:
        ap.error("--steepness must be >= 1")
    out: dict[str, Any] = {}
    plots = Path(args.plot_dir)
    plots.mkdir(parents=True, exist_ok=True)
    if args.mode in ("both", "sim"):
        out["sim_8gpu"] = run_sims(args, plots)
    if args.mode in ("both", "cpu"):
        cpu = run_cpu(args)
        print(f"CPU stack ({cpu['setup']['cpus']} CPUs): {CPU_SLO.describe()}")
        print(table(cpu["rows"], "worker"), flush=True)
        print("mean attainment:", cpu["mean_attainment"], flush=True)
        plot_timeline(
            [r for r in cpu["rows"] if r["round"] == 0],
            cpu["schedule"],
            f"{MODEL}, {cpu['setup']['cpus']} CPUs: {CPU_SLO.describe()}",
            plots / "planner_ramp_cpu.png",
        )
        out["cpu"] = cpu
    Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


if __name__ == "__main__":
    main()
