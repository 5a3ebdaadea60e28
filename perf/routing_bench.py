"""KV-aware prefill routing against round-robin, side by side, with 2 prefill workers each.

Two `pdserve up --prefill-workers 2 --decode-workers 1` stacks run at once, one per policy
(`--prefill-routing kv|round-robin`), and get the same shared-prefix workload in alternating
rounds. Reports the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
response's `usage.prompt_tokens_details.cached_tokens`), request throughput and mean latency.

    python -m perf.routing_bench [--prefixes 8] [--requests 96] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from pdserve.services.control.processes import free_port

POLICIES = ("kv", "round-robin")


@dataclass
class SideResult:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, float | str | int]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "hit_rate": round(self.hit_rate, 4),
            "req_per_s": round(self.requests / self.seconds, 3) if self.seconds else 0.0,
            "mean_latency_s": round(sum(self.latencies) / len(self.latencies), 3)
            if self.latencies
            else 0.0,
        }


def start_stack(policy: str, port: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PDSERVE_PREFILL_ROUTING": policy,
    }
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--model",
        "demo",
        "--prefill-workers",
        "2",
        "--decode-workers",
        "1",
        "--port",
        str(port),
    ]
    return subprocess.Popen(
        argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


async def wait_ready(
    session: aiohttp.ClientSession, base: str, proc: subprocess.Popen, timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.returncode}")
        try:
            async with session.get(f"{base}/metrics") as r:
                text = await r.text()
            if text.count("pdserve_kv_cache_total_blocks{") >= 3:
                return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{base} never listed 3 workers")


async def one(
    session: aiohttp.ClientSession, base: str, prompt: list[int], side: SideResult
) -> None:
    body = {
        "model": "pdserve-demo-llama-v1",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{side.policy}: {r.status} {data}")
    side.latencies.append(time.perf_counter() - t0)
    usage = data["usage"]
    side.requests += 1
    side.prompt_tokens += usage["prompt_tokens"]
    side.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def run_round(
    session, base: str, prompts: list[list[int]], side: SideResult, concurrency: int
) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(p: list[int]) -> None:
        async with sem:
            await one(session, base, p, side)

    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(p) for p in prompts))
    side.seconds += time.perf_counter() - t0


def workload(prefixes: int, prefix_len: int, requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(32, 250) for _ in range(prefix_len)] for _ in range(prefixes)]
    return [
        heads[rng.randrange(prefixes)] + [rng.randrange(32, 250) for _ in range(16)]
        for _ in range(requests)
    ]


async def bench(args: argparse.Namespace, logs: Path) -> list[SideResult]:
    ports = {p: free_port() for p in POLICIES}
    procs = {p: start_stack(p, ports[p], logs / f"{p}.log") for p in POLICIES}
    results = {p: SideResult(p) for p in POLICIES}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            for p in POLICIES:
                await wait_ready(session, f"http://127.0.0.1:{ports[p]}", procs[p])
            prompts = workload(args.prefixes, args.prefix_len, args.requests, args.seed)
            rounds = [
                prompts[i : i + args.round_size] for i in range(0, len(prompts), args.round_size)
            ]
            for i, batch in enumerate(rounds):
                order = POLICIES if i % 2 == 0 else POLICIES[::-1]  # alternate who goes first
                for p in order:
                    await run_round(
                        session, f"http://127.0.0.1:{ports[p]}", batch, results[p], args.concurrency
                    )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return [results[p] for p in POLICIES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefixes", type=int, default=8, help="distinct shared prefixes")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--round-size", type=int, default=16, help="requests per alternating round")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--logs", type=Path, default=Path("perf/results/routing-logs"))
    args = ap.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    kv, rr = asyncio.run(bench(args, args.logs))
    print("| routing | requests | prefix hit rate | req/s | mean latency s |")
    print("|---|---:|---:|---:|---:|")
    for r in (kv, rr):
        s = r.summary()
        print(
            f"| {s['policy']} | {s['requests']} | {100 * r.hit_rate:.1f}% | {s['req_per_s']} | {s['mean_latency_s']} |"
        )
    ratio = (
        (kv.requests / kv.seconds) / (rr.requests / rr.seconds)
        if kv.seconds and rr.seconds
        else 0.0
    )
    print(
        f"hit rate {100 * kv.hit_rate:.1f}% vs {100 * rr.hit_rate:.1f}%; throughput ratio kv/round-robin {ratio:.2f}x"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "sides": [asdict(kv) | kv.summary(), asdict(rr) | rr.summary()],
                    "throughput_ratio": round(ratio, 3),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
