"""A decode worker dies under load: what do clients see? (issue 19)

    python -m perf.migration_bench [--model demo] [--requests 100] [--rate 2] [--json PATH]

Starts NATS, one prefill worker, two decode workers and the gateway as local processes (default
options: 0.5 s heartbeats, the gateway's 3 s worker timeout unless --worker-timeout), sends ``--requests`` streaming
completions at ``--rate`` requests/s (Poisson arrivals, seeded), and at a random point between
20% and 80% of the arrivals kill -9s the decode worker serving more streams. Reports:

- completed vs failed requests (target: 100% completed);
- the migrated requests (a spy on the bus sees a second DecodeRequest for them) and the gap in
  their token stream: the longest pause between two chunks (or before the first, for a request
  that moved before any text reached its client), and that pause minus the usual one there -
  the request's median inter-chunk time, or the others' median TTFT: the extra latency;
- output throughput (tokens/s reaching clients) before the kill and after it, over the part of
  the run that still had arrivals (and from the moment every migrated stream was going again);
- the gateway's ``pdserve_request_migrations_total`` and the KV blocks left in use afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nats
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.control.bench.arrivals import arrival_offsets, paced
from pdserve.services.control.bench.client import discover_model
from pdserve.services.control.bench.datasets import BenchRequest
from pdserve.services.control.launcher import service_argv
from pdserve.services.control.processes import Child, NatsServer, free_port, spawn
from pdserve.shared.bus.protocol import decode
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.options import service_env
from perf.bench.topology import registered_workers

QUIET = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


@dataclass
class Record:
    """One request as its client saw it; times in seconds from the run's start."""

    rid: str
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)
    finish: str | None = None
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.error and self.finish == "length"


async def stream_one(
    session: aiohttp.ClientSession, url: str, model: str, rid: str, req: BenchRequest, t0: float
) -> Record:
    """Stream one completion, with the usage so far on every chunk (continuous usage stats)."""
    rec = Record(rid, time.perf_counter() - t0)
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    try:
        async with session.post(url, json=body, headers={"x-request-id": rid}) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                now = time.perf_counter() - t0
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = json.dumps(data["error"])[:300]
                    return rec
                usage = data.get("usage") or {}
                if data.get("choices") and usage.get("completion_tokens"):
                    rec.chunks.append((now, int(usage["completion_tokens"])))
                    rec.finish = data["choices"][0].get("finish_reason") or rec.finish
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


class Stack:
    """1P2D and a gateway, as plain processes (no CPU pinning: they share the machine)."""

    def __init__(self, model: str, logs: Path, gateway_options: dict[str, object]) -> None:
        self.logs = logs
        self.nats = NatsServer(log_path=logs / "nats.log", workdir=logs)
        self.nats.start()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")} | QUIET
        common = {"model": model, "nats_url": self.nats.url}
        self.children: dict[str, Child] = {}
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
            env = service_env({**common, "worker_id": name}, base)
            self.children[name] = spawn(name, service_argv(role), env, logs / f"{name}.log")
        env = service_env({**common, "port": self.port, **gateway_options}, base)
        self.children["gw"] = spawn("gw", service_argv("gateway"), env, logs / "gw.log")

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while registered_workers(self.base_url) != {"prefill": 1, "decode": 2}:
            for child in self.children.values():
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited; see {child.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError("the stack did not come up")
            time.sleep(0.5)

    def stop(self) -> None:
        for child in self.children.values():
            child.stop(10.0)
        self.nats.stop()


class DecodeSpy:
    """Client request id -> the decode workers its DecodeRequests went to, in order."""

    def __init__(self) -> None:
        self.sent: dict[str, list[str]] = defaultdict(list)

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url)

        async def on_msg(msg) -> None:
            body = decode(msg.data)
            if isinstance(body, DecodeRequest) and body.client_id:
                self.sent[body.client_id].append(msg.subject.rsplit(".", 1)[1])

        await self.nc.subscribe("pdserve.decode.*", cb=on_msg)
        await self.nc.flush()


def workload(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    # ids inside the vocabulary, clear of the usual special tokens at its bottom
    return [BenchRequest(rng.integers(3, vocab, prompt_len).tolist(), output_len) for _ in range(n)]


async def run(args: argparse.Namespace, stack: Stack, spy: DecodeSpy) -> dict:
    url = stack.base_url + "/v1/completions"
    requests = workload(args.requests, args.prompt_len, args.max_tokens, args.vocab, args.seed)
    rng = np.random.default_rng(args.seed)
    offsets = arrival_offsets(len(requests), args.rate, 1.0, rng)
    kill_at = float(rng.uniform(0.2, 0.8) * offsets[-1])
    tasks: dict[str, asyncio.Task] = {}
    killed: dict[str, object] = {}

    async def killer(start: float) -> None:
        await asyncio.sleep(max(0.0, start + kill_at - time.perf_counter()))
        running = [spy.sent[r][-1] for r, t in tasks.items() if r in spy.sent and not t.done()]
        victim = max(("d0", "d1"), key=running.count)
        stack.children[victim].signal(signal.SIGKILL)
        killed.update(worker=victim, at=time.perf_counter() - start, streams=running.count(victim))

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        kill_task = asyncio.create_task(killer(start))
        async for i, req in paced(requests, offsets, start):
            rid = f"mig-{args.seed}-{i}"
            tasks[rid] = asyncio.create_task(
                stream_one(session, url, args.model_name, rid, req, start)
            )
        records = list(await asyncio.gather(*tasks.values()))
        await kill_task
    return summarize(records, spy, killed, float(offsets[-1]))


def summarize(records: list[Record], spy: DecodeSpy, killed: dict, last_arrival: float) -> dict:
    kill = float(killed["at"])
    completed = [r for r in records if r.completed]
    migrated = [r for r in records if len(spy.sent.get(r.rid, [])) > 1]
    others = [r for r in completed if r not in migrated and r.chunks]
    typical_ttft = float(np.median([r.chunks[0][0] - r.sent for r in others]))
    stalls = [_stall(r, typical_ttft) for r in migrated if r.chunks]

    def throughput(lo: float, hi: float) -> float:
        """Tokens that reached clients between lo and hi, per second."""
        tokens = 0
        for r in records:
            before = 0
            for t, so_far in r.chunks:
                if lo <= t < hi:
                    tokens += so_far - before
                before = so_far
        return tokens / max(hi - lo, 1e-9)

    def e2e(rs: list[Record]) -> list[float]:
        return [r.chunks[-1][0] - r.sent for r in rs if r.completed]

    first_send = min(r.sent for r in records)
    return {
        "requests": len(records),
        "completed": len(completed),
        "failed": len(records) - len(completed),
        "errors": sorted({r.error for r in records if r.error}),
        "killed_worker": killed["worker"],
        "killed_at_s": round(kill, 3),
        "streams_on_killed_worker": killed["streams"],
        "migrated": len(migrated),
        "gap_s": _stats([st["gap_s"] for st in stalls]),
        "extra_latency_s": _stats([st["extra_s"] for st in stalls]),
        "migrated_streams": stalls,
        "e2e_s_migrated": _stats(e2e(migrated)),
        "e2e_s_others": _stats(e2e([r for r in completed if r not in migrated])),
        "throughput_tok_s_before": round(throughput(first_send, kill), 1),
        "throughput_tok_s_after": round(throughput(kill, last_arrival), 1),
        # once every migrated stream is going again
        "throughput_tok_s_after_recovery": round(
            throughput(kill + max((st["gap_s"] for st in stalls), default=0.0), last_arrival), 1
        ),
    }


def _stall(r: Record, typical_ttft: float) -> dict:
    """The longest pause a migrated stream saw - between two chunks, or before its first one
    when it moved before any text reached the client - and what it cost beyond the usual
    pause there (its median inter-chunk time, or the other requests' median TTFT)."""
    times = [r.sent] + [t for t, _ in r.chunks]
    pauses = np.diff(times)
    worst = int(pauses.argmax())
    usual = typical_ttft if worst == 0 else float(np.median(pauses[1:]))
    return {
        "rid": r.rid,
        "tokens_before": 0 if worst == 0 else r.chunks[worst - 1][1],
        "gap_s": round(float(pauses[worst]), 3),
        "extra_s": round(float(pauses[worst]) - usual, 3),
    }


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def report(result: dict) -> str:
    gap, extra = result["gap_s"], result["extra_latency_s"]
    lines = [
        "| what | measured |",
        "|---|---|",
        f"| completed / failed | **{result['completed']} / {result['failed']}** of "
        f"{result['requests']} |",
        f"| killed | {result['killed_worker']} at {result['killed_at_s']:.1f} s, serving "
        f"{result['streams_on_killed_worker']} streams |",
        f"| migrated requests | {result['migrated']} (gateway counter: "
        f"{result.get('migrations_counter')}) |",
        f"| gap in a migrated stream, p50 / max | {gap.get('p50')} / {gap.get('max')} s |",
        f"| extra latency (gap - usual pause), p50 / max | {extra.get('p50')} / "
        f"{extra.get('max')} s |",
        f"| output tok/s before / after the kill (after recovery) | "
        f"{result['throughput_tok_s_before']} / {result['throughput_tok_s_after']} "
        f"({result['throughput_tok_s_after_recovery']}) |",
        f"| KV blocks in use afterwards | {result.get('blocks_in_use_after')} |",
    ]
    return "\n".join(lines)


def gateway_counters(base_url: str) -> tuple[float, dict[str, float]]:
    """The gateway's migration counter (all reasons) and KV blocks in use per worker."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    migrations, blocks = 0.0, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_request_migrations_total":
                migrations += s.value
            elif s.name == "pdserve_kv_cache_used_blocks":
                blocks[s.labels["worker"]] = s.value
    return migrations, blocks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="what the workers serve (pdserve --model)")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are below this")
    p.add_argument("--seed", type=int, default=0, help="arrivals, prompts and the kill time")
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=3.0,
        help="the gateway's --worker-timeout: heartbeat silence before a worker is pinged "
        "(the default's; most of a migrated stream's gap)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-migration-"))
    stack = Stack(args.model, logs, {"worker_timeout": args.worker_timeout})
    try:
        stack.wait_ready()
        args.model_name = asyncio.run(discover_model(stack.base_url))

        async def go() -> dict:
            spy = DecodeSpy()
            await spy.start(stack.nats.url)
            try:
                return await run(args, stack, spy)
            finally:
                await spy.nc.close()

        result = asyncio.run(go())
        time.sleep(3.0)  # a heartbeat or two: the survivors' block counts settle
        result["migrations_counter"], result["blocks_in_use_after"] = gateway_counters(
            stack.base_url
        )
        result["options"] = {k: v for k, v in vars(args).items() if k != "json"}
        result["options"]["json"] = str(args.json) if args.json else None
        result["logs"] = str(logs)
    finally:
        stack.stop()
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
