"""Zero-downtime rollout and the warm pool, measured on a real CPU stack (issue 32).

**Rollout.** ``pdserve up`` (1P1D) serves a steady open-loop Poisson load (``--rate`` req/s,
seeded) of streamed ``/v1/completions``: prompts of ``--isl`` random token ids (10-249: every vocabulary has them), ``--osl`` output
tokens (greedy, ignore_eos). After ``--before`` seconds ``pdserve rollout`` swaps in a new
version (default: the same checkpoint under the version name ``v2``, so what is measured is the
cost of the swap itself: a second 1P1D loading beside the first on the same cores, the probe,
the switch, the drain); the load goes on ``--after`` seconds past its end. Reported per phase
(before / during the rollout / after): requests, failures, p50 and p99 TTFT, p99 TPOT (a
request's mean inter-token time), and the rollout's own phase times.

**Warm pool vs cold start.** ``pdserve up --autoscale`` with a profile that makes three
closed-loop clients need a second decode worker, run twice: with ``--warm-decode-workers 1``
(the scale-up promotes the pooled worker) and without (it cold-starts one). Reported: the time
from the scale-up (the launcher's "promoted" / "started" line) to the new worker's first decode
step (its own /metrics).

    .venv/bin/python -m perf.rollout_bench                     # both, SmolLM2-135M
    .venv/bin/python -m perf.rollout_bench --model demo --part rollout

Writes perf/results/rollout_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from pdserve.services.control.bench.client import ClientConfig, RequestRecord, send_completion
from pdserve.services.control.bench.datasets import BenchRequest
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results" / "rollout_bench.json"
SERVED = "bench-model"
STEPS = 'pdserve_worker_decode_step_seconds_count{role="decode"}'


def start_stack(model: str, args: list[str], log: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(
        UCX_WARN_UNUSED_ENV_VARS="n",
        TOKENIZERS_PARALLELISM="false",
        PDSERVE_HEARTBEAT_SECONDS="0.2",
    )
    env.pop("OMP_NUM_THREADS", None)
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--model",
        model,
        "--port",
        str(port),
        "--served-model-name",
        SERVED,
        *args,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "pdserve ready at" not in (text := log.read_text(errors="replace")):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_stack(proc)
            raise RuntimeError(f"pdserve up did not start:\n{text[-3000:]}")
        time.sleep(0.2)
    nats = re.search(r"nats: (nats://[0-9.:]+)", text).group(1)
    return proc, f"http://127.0.0.1:{port}", nats


def stop_stack(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else None


def summary(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    tpot = [float(np.mean(r.itl)) for r in ok if r.itl]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_p50_ms": pct([r.ttft for r in ok], 50),
        "ttft_p99_ms": pct([r.ttft for r in ok], 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
    }


# ---- rollout under load ---------------------------------------------------------------------


async def rollout_under_load(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    proc, base, nats = start_stack(args.model, ["--model-version", "v1"], workdir / "up.log")
    try:
        rng = np.random.default_rng(0)
        cfg = ClientConfig(base, SERVED, timeout=300.0)
        records: list[RequestRecord] = []
        stop = asyncio.Event()
        marks: dict[str, float] = {}

        async def load(session: aiohttp.ClientSession) -> None:
            start, tasks, i = time.perf_counter(), [], 0
            while not stop.is_set():
                req = BenchRequest(rng.integers(10, 250, args.isl).tolist(), args.osl)
                tasks.append(asyncio.create_task(send_completion(session, cfg, req, i, start)))
                i += 1
                await asyncio.sleep(rng.exponential(1.0 / args.rate))
            records.extend(await asyncio.gather(*tasks))
            marks["start"] = start

        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            driver = asyncio.create_task(load(session))
            await asyncio.sleep(args.before)
            began = time.perf_counter()
            cmd = [
                sys.executable,
                "-m",
                "pdserve.cli",
                "rollout",
                "--nats-url",
                nats,
                "--model",
                args.new_model or args.model,
                "--model-version",
                "v2",
            ]
            done = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, cwd=ROOT)
            out, _ = await done.communicate()
            ended = time.perf_counter()
            await asyncio.sleep(args.after)
            stop.set()
            await driver
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as resp:
            versions = json.loads(resp.read())["data"][0]["model_versions"]
    finally:
        stop_stack(proc)
    answer = json.loads(out or b"{}")
    t0 = marks["start"]
    phase = {
        "before": [r for r in records if t0 + r.start_time < began],
        "during": [r for r in records if began <= t0 + r.start_time < ended],
        "after": [r for r in records if t0 + r.start_time >= ended],
    }
    return {
        "rollout_rc": done.returncode,
        "rollout": answer,
        "versions_after": versions,
        "rollout_seconds": round(ended - began, 2),
        **{name: summary(rs) for name, rs in phase.items()},
    }


# ---- warm pool vs cold start ----------------------------------------------------------------


def profile(path: Path) -> Path:
    """One decode worker 'does' 40 tok/s: three clients at 32 tokens need two (a trigger)."""
    Profile(
        prefill_lens=(1, 4096),
        prefill_tokens_per_s=(1e6, 1e6),
        decode_batches=(1, 2),
        decode_contexts=(16, 4096),
        decode_itl_ms=((25.0, 25.0), (1e5, 1e5)),
        kv_capacity_tokens=100_000,
        note="rollout_bench: a scale-up trigger",
    ).save(path)
    return path


def served(worker_metrics: str, gateway: str, worker: str) -> bool:
    """Whether ``worker`` has served: its own decode-step count, or (should its metrics port be
    unreachable) a running sequence in the gateway's view of it."""
    running = f'pdserve_running_requests{{worker="{worker}",role="decode"}}'
    for url, series in ((worker_metrics, STEPS), (gateway, running)):
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=1) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith(series + " ") and float(line.rsplit(" ", 1)[1]) > 0:
                        return True
        except OSError:
            pass
    return False


async def scale_up(args: argparse.Namespace, workdir: Path, warm: bool) -> dict[str, Any]:
    metrics = free_port()
    flags = [
        "--autoscale",
        "--planner-profile",
        str(profile(workdir / "profile.json")),
        "--max-prefill-workers",
        "1",
        "--max-decode-workers",
        "2",
        "--autoscale-max-cpus",
        "4",
        "--autoscale-interval",
        "2",
        "--planner-warmup-seconds",
        "0",
        "--slo-itl-ms",
        "50",
        "--metrics-port",
        str(metrics),
    ]
    if warm:
        flags += ["--warm-decode-workers", "1"]
    log = workdir / f"up-{'warm' if warm else 'cold'}.log"
    proc, base, _ = start_stack(args.model, flags, log)
    line = "promoted decode-1" if warm else "started decode-1"
    new = f"http://127.0.0.1:{metrics + 2}"  # slots: prefill-0, decode-0, then decode-1
    stop = asyncio.Event()
    try:
        cfg = ClientConfig(base, SERVED, timeout=300.0)
        rng = np.random.default_rng(0)

        async def client(session: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                req = BenchRequest(rng.integers(10, 250, args.isl).tolist(), 32)
                await send_completion(session, cfg, req)

        async with aiohttp.ClientSession() as session:
            clients = [asyncio.create_task(client(session)) for _ in range(3)]
            deadline = time.monotonic() + 180
            while line not in log.read_text(errors="replace"):
                assert time.monotonic() < deadline, f"no scale-up:\n{log.read_text()[-3000:]}"
                await asyncio.sleep(0.02)
            at = time.monotonic()
            while not await asyncio.to_thread(served, new, base, "decode-1"):
                if time.monotonic() > at + 120:
                    raise RuntimeError(f"decode-1 never served:\n{log.read_text()[-3000:]}")
                await asyncio.sleep(0.02)
            first = time.monotonic() - at
            stop.set()
            await asyncio.gather(*clients)
    finally:
        stop_stack(proc)
    return {"scale_up_to_first_decode_step_s": round(first, 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--new-model", default="", help="the rollout's model (default: --model)")
    p.add_argument("--part", choices=("all", "rollout", "warm"), default="all")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--isl", type=int, default=64)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--before", type=float, default=30.0)
    p.add_argument("--after", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    result: dict[str, Any] = {
        "model": args.model,
        "workload": {
            "rate_req_s": args.rate,
            "isl": args.isl,
            "osl": args.osl,
            "cpus": os.cpu_count(),
        },
    }
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        workdir = Path(tmp)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        parts = {
            "rollout": lambda: rollout_under_load(args, workdir),
            "warm_pool": lambda: scale_up(args, workdir, warm=True),
            "cold_start": lambda: scale_up(args, workdir, warm=False),
        }
        for name, part in parts.items():
            if args.part in ("all", "rollout" if name == "rollout" else "warm"):
                try:
                    result[name] = asyncio.run(part())
                except (RuntimeError, AssertionError) as exc:  # the others still run
                    result[name] = {"error": str(exc)[-3000:]}
                args.out.write_text(json.dumps(result, indent=2))  # what is done, kept
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
