"""KV offload tiers on the served stack (issue 33, "Measure"): TTFT and throughput with tiers
against without, the hit rate per tier, and the first request of a known prefix after a restart,
served from disk against recomputed.

**Stack.** ``pdserve up`` on loopback, 1 prefill + 1 decode worker (KV pulled over UCX), the
built-in SmolLM2-135M-Instruct in float32 on the CPU, a pool of ``--pool`` KV blocks of 16 tokens
per worker (``--tensor-parallel-size``: each worker's ranks, which hold their own shards of the
pool and of the tiers). "tiers" adds ``--kv-offload-ram-gib`` for ``--host-blocks`` blocks (fewer than the
working set, so host memory evicts too and the disk tier serves) and ``--kv-offload-disk`` (one
directory for all tiers runs, which ``pdserve up`` gives both workers); "off" has neither.

**Workload.** ``--prefixes`` distinct random prefixes of ``--prefix-blocks`` full blocks (shared
documents or system prompts), each asked ``--repeats`` times: each pass asks every prefix once
in a shuffled order, so between two asks of one prefix some 1 to 2x``--prefixes`` others pass
through the pool (a short distance: host memory still has it; a long one: disk). Each request is
its prefix plus 8 random tokens of its own and generates ``--max-tokens`` greedy tokens
(ignore_eos), streamed; ``--concurrency`` requests in flight. The working set (prefixes x prefix
blocks) must be at least 4x the pool; a run whose prefill worker evicted no prefix block (tiers:
nothing offloaded, no tier hit; off: repeats found in the pool) is an error, not a result.
TTFT is the time to the first streamed token; throughput is output tokens over the run's wall
time. The configurations alternate (off, tiers, off, tiers, ...: ``--rounds``) and medians are
reported, per request over all rounds.

**Restart probe.** From round 2 on, each stack starts with ``--probes`` prefixes of the
previous round's workload that nobody asked for since: the tiers stack on the previous tiers
run's disk directory (its workers restarted: the index rebuilt from the files), the off stack
with nothing. Each probe is that prefix's first request after the start: from disk against
recomputed. The round's load then runs on the same stack; it uses prefixes of its own, so the
earlier rounds' blocks on disk are never hit again.

    python -m perf.kv_offload_bench [--rounds 2] [--json perf/results/kv_offload_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from pdserve.services.control.processes import free_port
from pdserve.shared.models.resolve import resolve
from perf.stack_bench import start_stack, stop_stack

MODEL = "smollm2-135m-instruct"
BLOCK = 16
SUFFIX = 8  # tokens of each request's own after its prefix
METRIC = "pdserve_worker_prefix_cache_"


def block_bytes(model: str) -> int:
    """One float32 KV block of ``model`` (what a tier stores per block)."""
    cfg = json.loads((resolve(model).path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


def make_prefixes(seed: int, n: int, blocks: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(blocks * BLOCK)] for _ in range(n)]


def make_requests(prefixes: list[list[int]], repeats: int, seed: int) -> list[list[int]]:
    """Each pass asks every prefix once, in its own shuffled order: reuse distances vary."""
    rng = random.Random(seed)
    order = [i for r in range(repeats) for i in rng.sample(range(len(prefixes)), len(prefixes))]
    return [prefixes[i] + [rng.randrange(100, 40000) for _ in range(SUFFIX)] for i in order]


def scrape(port: int) -> dict[str, float]:
    """The prefill worker's prefix-cache series (tier hits keyed by tier)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC):
            continue
        name, value = line.rsplit(" ", 1)
        key = name.removeprefix(METRIC).split("{")[0]
        if key.endswith("_created"):
            continue
        key = key.removesuffix("_total")
        if 'tier="' in name:
            key += "." + name.split('tier="')[1].split('"')[0]
        out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], n: int) -> float:
    """TTFT (s) of one streamed greedy request; checks that all ``n`` tokens came."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft, chunks = None, 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                chunks += 1
    if ttft is None or chunks == 0:
        raise RuntimeError("no token streamed")
    return ttft


async def run_load(url: str, requests: list[list[int]], n: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = [0.0] * len(requests)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await one(session, url, [5, 6, 7, 8], 2)  # warm-up: first pull, first forward

        async def go(i: int) -> None:
            async with sem:
                ttfts[i] = await one(session, url, requests[i], n)

        start = time.perf_counter()
        await asyncio.gather(*(go(i) for i in range(len(requests))))
        seconds = time.perf_counter() - start
    return {"ttfts": ttfts, "seconds": seconds, "tok_s": len(requests) * n / seconds}


async def run_probes(url: str, prompts: list[list[int]], n: int) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return [await one(session, url, p, n) for p in prompts]  # one at a time, each first


def wait_scanned(port: int, timeout: float = 60.0) -> float:
    """Blocks the restarted prefill worker's disk tier indexed (its start-up scan ran)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (held := scrape(port).get("tier_blocks.disk", 0.0)) > 0:
            return held
        time.sleep(0.2)
    raise RuntimeError("the restarted worker's disk tier indexed nothing")


def free_port_pair() -> int:
    """A free port whose successor is free too (``pdserve up`` numbers workers' ports on)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def one_run(args, tiers: bool, rnd: int, tmp: Path) -> dict:
    metrics = free_port_pair()  # the prefill worker's; the decode worker's is the next port
    extra = [
        "--num-kv-blocks",
        str(args.pool),
        "--metrics-port",
        str(metrics),
        "--max-num-seqs",
        str(max(2, args.concurrency)),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
    ]
    if tiers:  # one directory for every tiers run: from round 1 on, each starts as a restart
        disk = tmp / "disk"
        gib = args.host_blocks * block_bytes(MODEL) / (1 << 30)
        extra += ["--kv-offload-ram-gib", f"{gib:.6f}", "--kv-offload-disk", str(disk)]
    proc, url = start_stack(MODEL, 1, tmp / f"up-{rnd}-{int(tiers)}.log", tuple(extra))
    try:
        out: dict = {"config": "tiers" if tiers else "off", "round": rnd}
        if rnd > 0:  # first requests of the previous round's unasked-since prefixes
            probe_prefixes = make_prefixes(1000 + rnd - 1, args.prefixes, args.prefix_blocks)
            probes = make_requests(probe_prefixes[: args.probes], 1, seed=77)
            if tiers:
                out["disk_blocks_at_start"] = wait_scanned(metrics)
            before = scrape(metrics)
            out["probe_ttfts"] = asyncio.run(run_probes(url, probes, args.max_tokens))
            out["probe_counters"] = delta(scrape(metrics), before)
        prefixes = make_prefixes(1000 + rnd, args.prefixes, args.prefix_blocks)
        requests = make_requests(prefixes, args.repeats, seed=rnd)
        before = scrape(metrics)
        out.update(asyncio.run(run_load(url, requests, args.max_tokens, args.concurrency)))
        after = scrape(metrics)
        out["counters"] = c = delta(after, before)
        # the prefill worker's measured load costs (gauges: what its heartbeats tell routers)
        gauges = {t: after.get(f"tier_load_cost.{t}", 0.0) for t in ("host", "disk")}
        out["load_costs"] = {t: round(v, 4) for t, v in gauges.items()}
        for t in gauges:
            c.pop(f"tier_load_cost.{t}", None)  # a gauge: no delta
    finally:
        stop_stack(proc)
    check_evicted(args, tiers, c)
    if tiers and c.get("tier_hits.host", 0) > 0 and out["load_costs"]["host"] <= 0:
        raise RuntimeError(f"host blocks were loaded but the load cost was not measured: {out}")
    return out


def check_evicted(args, tiers: bool, c: dict[str, float]) -> None:
    """A run that evicted nothing measures nothing: raise."""
    per_prompt = args.prefix_blocks  # full blocks a request can find (its suffix fills none)
    repeats = (args.repeats - 1) * args.prefixes * per_prompt  # blocks asked before
    if tiers:
        tier_hits = c.get("tier_hits.host", 0) + c.get("tier_hits.disk", 0)
        if c.get("offloaded", 0) <= 0 or tier_hits <= 0:
            raise RuntimeError(f"tiers run: nothing evicted to or loaded from a tier: {c}")
    elif c.get("hits", 0) >= 0.5 * repeats:
        raise RuntimeError(f"off run: {c.get('hits')} of {repeats} repeated blocks hit the pool")


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def summarize(args, runs: list[dict]) -> dict:
    out: dict = {}
    for cfg in ("off", "tiers"):
        mine = [r for r in runs if r["config"] == cfg]
        first = len(mine[0]["ttfts"]) // args.repeats  # the first pass: computed
        c: dict[str, float] = {}
        for r in mine:
            for k, v in r["counters"].items():
                c[k] = c.get(k, 0.0) + v
        queries = c.get("queries", 0.0) or 1.0
        host, disk = c.get("tier_hits.host", 0.0), c.get("tier_hits.disk", 0.0)
        out[cfg] = {
            "ttft_median_s": med([t for r in mine for t in r["ttfts"]]),
            "ttft_repeat_median_s": med([t for r in mine for t in r["ttfts"][first:]]),
            "tok_s_median": med([r["tok_s"] for r in mine]),
            "tok_s_runs": [round(r["tok_s"], 2) for r in mine],
            "hit_rate": {
                "pool": round((c.get("hits", 0.0) - host - disk) / queries, 3),
                "host": round(host / queries, 3),
                "disk": round(disk / queries, 3),
            },
            "offloaded_blocks": c.get("offloaded", 0.0),
            "load_costs": [r.get("load_costs") for r in mine],  # measured, per run (tiers)
            "probe_ttft_median_s": med([t for r in mine for t in r.get("probe_ttfts", [])])
            if any("probe_ttfts" in r for r in mine)
            else None,
        }
    off, on = out["off"], out["tiers"]
    out["ratios"] = {
        "ttft_repeat_off_over_tiers": round(
            off["ttft_repeat_median_s"] / on["ttft_repeat_median_s"], 2
        ),
        "ttft_off_over_tiers": round(off["ttft_median_s"] / on["ttft_median_s"], 2),
        "tok_s_tiers_over_off": round(on["tok_s_median"] / off["tok_s_median"], 2),
        "probe_recomputed_over_disk": round(
            off["probe_ttft_median_s"] / on["probe_ttft_median_s"], 2
        )
        if on["probe_ttft_median_s"]
        else None,
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2, help="off/tiers pairs (ABAB)")
    ap.add_argument("--pool", type=int, default=32, help="KV blocks per worker")
    ap.add_argument("--prefixes", type=int, default=12)
    ap.add_argument("--prefix-blocks", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-blocks", type=int, default=48, help="host memory tier, in blocks")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="each worker's TP size (its ranks hold their shards of the tiers)",
    )
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    working_set = args.prefixes * args.prefix_blocks
    if working_set < 4 * args.pool:
        ap.error(f"working set {working_set} blocks < 4x the pool ({args.pool})")
    runs: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-") as tmp:
        for rnd in range(args.rounds):
            for tiers in (False, True):  # ABAB
                runs.append(one_run(args, tiers, rnd, Path(tmp)))
                r = runs[-1]
                print(
                    f"round {rnd} {r['config']:5s}: {r['tok_s']:.2f} tok/s, TTFT median "
                    f"{med(r['ttfts'])} s, probes {r.get('probe_ttfts')}, load costs "
                    f"{r['load_costs']}",
                    flush=True,
                )
    result = {
        "workload": {k: v for k, v in vars(args).items() if k != "json"}
        | {
            "model": MODEL,
            "block_tokens": BLOCK,
            "suffix_tokens": SUFFIX,
            "working_set_blocks": working_set,
            "working_set_over_pool": working_set / args.pool,
            "stack": f"pdserve up 1P1D, TP {args.tensor_parallel_size} each, loopback, "
            "float32, CPU",
        },
        "summary": summarize(args, runs),
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
