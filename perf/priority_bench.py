"""The time to first token of a high-priority request behind a full queue, under
``--scheduling-policy priority`` against ``fcfs``, side by side in one run.

On a real ``pdserve up`` (gateway, NATS, 1 prefill + 1 decode worker as processes; the model and
tokenizer of ``perf/stack_bench.py``) each round sends ``--low`` requests at once with long
random prompts (priority 10 under ``priority``; 0 under ``fcfs``, which refuses any other), waits
``--settle`` seconds so they are queued on the prefill worker, then sends one request with a
short prompt (priority -10 under ``priority``; 0 under ``fcfs``) and times its first streamed
token. The low ones' TTFTs are reported too: what priority costs them.

    python -m perf.priority_bench [--low 24] [--rounds 3] [--json perf/results/priority_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from perf.engine_bench import make_model
from perf.stack_bench import add_tokenizer, start_stack, stop_stack

HIGH, LOW = -10, 10


@dataclass
class PolicyRun:
    policy: str
    high_ttft_s: list[float]  # per round
    high_ttft_median_s: float
    low_ttft_median_s: float  # over every round's low requests
    low_ttft_max_s: float


@dataclass
class Result:
    low_requests: int
    low_prompt_tokens: int
    high_prompt_tokens: int
    max_tokens: int
    settle_s: float
    rounds: int
    stack_flags: list[str]
    runs: list[PolicyRun]
    fcfs_over_priority: float  # median high TTFT under fcfs / under priority
    cpus: int


async def ttft(session: aiohttp.ClientSession, url: str, prompt: list[int], priority: int, n: int):
    """Seconds from sending to the first streamed token."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0.0}
    body.update(ignore_eos=True, stream=True, priority=priority)
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"bad answer ({resp.status}): {(await resp.text())[:300]}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token streamed")
    return first


async def rounds(
    url: str, args: argparse.Namespace, policy: str
) -> tuple[list[float], list[float]]:
    rng = random.Random(0)  # the same prompts under both policies
    high, low = (HIGH, LOW) if policy == "priority" else (0, 0)
    timeout = aiohttp.ClientTimeout(total=3600)
    highs: list[float] = []
    lows: list[float] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await ttft(session, url, [5] * 8, 0, 2)  # warm-up: first pull endpoints, first forward
        for _ in range(args.rounds):
            prompts = [
                [rng.randrange(2, args.vocab) for _ in range(args.low_tokens)]
                for _ in range(args.low)
            ]
            tasks = [
                asyncio.create_task(ttft(session, url, p, low, args.max_tokens)) for p in prompts
            ]
            await asyncio.sleep(args.settle)  # all queued on the prefill worker
            short = [rng.randrange(2, args.vocab) for _ in range(args.high_tokens)]
            highs.append(await ttft(session, url, short, high, args.max_tokens))
            lows += await asyncio.gather(*tasks)
    return highs, lows


def main(argv: list[str] | None = None) -> Result:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--low", type=int, default=24, help="low-priority requests per round")
    ap.add_argument("--low-tokens", type=int, default=384, help="each low one's prompt")
    ap.add_argument("--high-tokens", type=int, default=32, help="the high one's prompt")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds before the high one")
    ap.add_argument("--rounds", type=int, default=3)
    # smaller than stack_bench's model: on 2 vCPUs a round's queue drains in seconds
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    # one prompt chunk of 256 tokens per step: the prefill worker's queue drains slowly
    flags = ["--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--priority-aging-s", "0"]
    flags += ["--prefill-timeout", "600"]  # a full queue is the point: no retries elsewhere
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "llama", args.layers, args.hidden, args.vocab)
        add_tokenizer(model_dir, args.vocab)
        for policy in ("fcfs", "priority"):
            extra = (*flags, "--scheduling-policy", policy)
            proc, url = start_stack(model_dir, 1, Path(tmp) / f"up-{policy}.log", extra)
            try:
                highs, lows = asyncio.run(rounds(url, args, policy))
            finally:
                stop_stack(proc)
            runs.append(
                PolicyRun(
                    policy=policy,
                    high_ttft_s=[round(s, 3) for s in highs],
                    high_ttft_median_s=round(statistics.median(highs), 3),
                    low_ttft_median_s=round(statistics.median(lows), 3),
                    low_ttft_max_s=round(max(lows), 3),
                )
            )
    fcfs, prio = runs
    res = Result(
        low_requests=args.low,
        low_prompt_tokens=args.low_tokens,
        high_prompt_tokens=args.high_tokens,
        max_tokens=args.max_tokens,
        settle_s=args.settle,
        rounds=args.rounds,
        stack_flags=flags,
        runs=runs,
        fcfs_over_priority=round(fcfs.high_ttft_median_s / prio.high_ttft_median_s, 1),
        cpus=len(os.sched_getaffinity(0)),
    )
    for r in runs:
        print(
            f"{r.policy:8s}  high TTFT median {r.high_ttft_median_s:6.3f} s {r.high_ttft_s}   "
            f"low TTFT median {r.low_ttft_median_s:6.3f} s, max {r.low_ttft_max_s:6.3f} s"
        )
    print(f"high-priority TTFT: fcfs / priority = {res.fcfs_over_priority}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(res), indent=2))
    return res


if __name__ == "__main__":
    main()
