"""Layer-wise KV streaming against bulk pulls (issue 29 item 3), over HTTP, on loopback and
between network namespaces (``tests/multihost``'s topology; needs root and ``ip netns``).

Workload: SmolLM2-135M-Instruct (fp32, the default model), one prefill and one decode worker,
one thread each, a gateway and a 3-node NATS cluster (one node per role, as
``perf/multihost_bench.py``). Prompts of random token ids (a fresh prompt every request, so no
prefix cache helps) of 256 / 2048 / 8000 tokens, one request at a time, 4 output tokens,
greedy. Per request, through the SSE stream: TTFT (the first token comes from the prefill
worker in both modes) and the gap to the second token, which holds the KV pull in bulk mode
(``--kv-stream-threshold 0`` on both workers) and only what the pull could not hide under
prefill when streamed (threshold 1: every prompt streams, in 4 layer groups). The decode
worker's ``pdserve_kv_transfer_seconds`` gives the bulk pull's own time, so

    saved_per_pull = (gap_bulk - gap_streamed) / pull_bulk

is the share of the pull that streaming took off the critical path (``saved_per_pull``; above 1
when the gateway-to-decode hand-off went off it too). The two modes alternate
(bulk, streamed, bulk, streamed: a stack each) within each network.

    python -m perf.kv_stream_bench --json perf/results/kv_stream_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.control.processes import NatsCluster
from tests.integration.migration_stack import worker_blocks
from tests.integration.stack import free_port, start_service, stop_all
from tests.multihost import netns
from tests.multihost.hosts import namespace_stack

SIZES = (256, 2048, 8000)
VOCAB = (200, 40000)  # plain-text ids of SmolLM2's 49152
MODEL = "smollm2-135m-instruct"
# an 8k-token prompt takes about a minute on one thread here: past the gateway's defaults
GATEWAY = {"model": MODEL, "prefill_timeout": 900, "first_token_timeout": 900}
WORKER = {
    "model": MODEL,
    "num_kv_blocks": 1200,  # two 8k prompts and change, at block size 16
    "heartbeat_seconds": 0.5,
    "kv_failure_policy": "fail",  # a failed pull must show, not be recomputed
    "local_prefill_threshold": 0,
    "max_model_len": 8192,
}
METRICS_PORT = 9464


async def one(base: str, model: str, size: int, rng: random.Random) -> tuple[float, float]:
    """(TTFT, gap to the second token) in seconds, of one streamed request."""
    body = {
        "model": model,
        "prompt": [rng.randrange(*VOCAB) for _ in range(size)],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps: list[float] = []
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        async with session.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {") and b'"text"' in line:
                    stamps.append(time.perf_counter())
    assert len(stamps) >= 2, f"only {len(stamps)} chunks"
    return stamps[0] - t0, stamps[1] - stamps[0]


def pull_seconds(text: str) -> tuple[float, float]:
    """(sum, count) of the decode worker's pdserve_kv_transfer_seconds."""
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_kv_transfer_seconds":
            for s in family.samples:
                if s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = s.value
    return total, count


async def measure(base: str, scrape, reps: dict[int, int], seed: int) -> dict:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
    await one(base, model, 64, rng)  # warm-up: endpoints, first forward
    out = {}
    for size in SIZES:
        before = pull_seconds(scrape())
        runs = [await one(base, model, size, rng) for _ in range(reps[size])]
        after = pull_seconds(scrape())
        pulls = after[1] - before[1]
        out[size] = {
            "ttft_s": [round(t, 4) for t, _ in runs],
            "gap_s": [round(g, 4) for _, g in runs],
            "pull_s_mean": round((after[0] - before[0]) / pulls, 4) if pulls else None,
        }
    return out


def wait_ready(base: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while set(worker_blocks(base)) != {"p0", "d0"}:
        if time.monotonic() > deadline:
            raise TimeoutError("stack did not come up")
        time.sleep(0.3)


def options(streamed: bool) -> dict:
    return {**WORKER, "kv_stream_threshold": 1 if streamed else 0}


def run_loopback(logs: Path, streamed: bool, reps: dict[int, int], seed: int) -> dict:
    cluster = NatsCluster.local(3, logs)
    cluster.start()
    port, metrics = free_port(), free_port()
    opts = options(streamed)
    children = []
    try:
        children.append(
            start_service("gateway", cluster.client_url(0), logs, options={"port": port, **GATEWAY})
        )
        children.append(
            start_service(
                "prefill", cluster.client_url(1), logs, options={**opts, "worker_id": "p0"}
            )
        )
        children.append(
            start_service(
                "decode",
                cluster.client_url(2),
                logs,
                options={**opts, "worker_id": "d0", "metrics_port": metrics},
            )
        )
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)

        def scrape() -> str:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
                return r.read().decode()

        return asyncio.run(measure(base, scrape, reps, seed))
    finally:
        stop_all(children)
        cluster.stop()


def run_namespaces(logs: Path, streamed: bool, reps: dict[int, int], seed: int) -> dict:
    opts = options(streamed)
    decode = {**opts, "metrics_port": METRICS_PORT}
    with namespace_stack(logs, opts, decode, GATEWAY) as stack:
        decode_host = stack.topo.hosts["c"]
        url = f"http://{decode_host.address}:{METRICS_PORT}/metrics"
        code = f"import urllib.request;print(urllib.request.urlopen({url!r}).read().decode())"

        def scrape() -> str:  # /metrics listens on the host's 198.18 address only
            argv = decode_host.argv(sys.executable, "-c", code)
            return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

        return asyncio.run(measure(stack.base_url, scrape, reps, seed))


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per size: medians over every request of each mode, and what streaming saved of the gap
    to the second token against the bulk pull's own time (``saved_per_pull`` above 1: the
    hand-off from the gateway to the decode worker - its request, admission, the pull's
    request - went off the critical path too)."""
    out = {}
    for size in SIZES:
        bulk = [r[size] for r in runs["bulk"]]
        stream = [r[size] for r in runs["streamed"]]

        def med(rows, key):
            return statistics.median(x for r in rows for x in r[key])

        pulls = [r["pull_s_mean"] for r in bulk if r["pull_s_mean"] is not None]
        pull = statistics.median(pulls) if pulls else None
        gap_b, gap_s = med(bulk, "gap_s"), med(stream, "gap_s")
        ttft_b, ttft_s = med(bulk, "ttft_s"), med(stream, "ttft_s")
        out[size] = {
            "ttft_bulk_s": round(ttft_b, 4),
            "ttft_streamed_s": round(ttft_s, 4),
            "gap_bulk_s": round(gap_b, 4),
            "gap_streamed_s": round(gap_s, 4),
            "saved_s": round(gap_b - gap_s, 4),
            "second_token_ratio": round((ttft_s + gap_s) / (ttft_b + gap_b), 4),
            "pull_bulk_s": pull,
            "saved_per_pull": round((gap_b - gap_s) / pull, 3) if pull else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, nargs=3, default=[5, 3, 1], help="per size, per stack")
    ap.add_argument("--rounds", type=int, default=2, help="bulk/streamed stacks per network")
    ap.add_argument("--networks", nargs="+", default=["loopback", "namespaces"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--summarize", type=Path, help="only summarize the runs of a --json file")
    args = ap.parse_args()
    if args.summarize:
        done = json.loads(args.summarize.read_text())
        for network in ("loopback", "namespaces"):
            if network in done:
                runs = {
                    m: [{int(k): v for k, v in r.items()} for r in rs]
                    for m, rs in done[network]["runs"].items()
                }
                done[network]["summary"] = summarize(runs)
                print(network, json.dumps(done[network]["summary"], indent=2))
        args.summarize.write_text(json.dumps(done, indent=2) + "\n")
        return
    reps = dict(zip(SIZES, args.reps, strict=True))
    if "namespaces" in args.networks and (reason := netns.unavailable_reason()):
        raise SystemExit(f"kv_stream_bench: {reason}")
    logs = Path(tempfile.mkdtemp(prefix="pdserve-kv-stream-bench-"))
    result: dict = {"sizes": SIZES, "reps": reps, "rounds": args.rounds, "logs": str(logs)}
    for network in args.networks:
        run = run_loopback if network == "loopback" else run_namespaces
        runs: dict[str, list[dict]] = {"bulk": [], "streamed": []}
        for i in range(args.rounds):
            for mode in ("bulk", "streamed"):
                where = logs / f"{network}-{mode}-{i}"
                where.mkdir()
                runs[mode].append(run(where, mode == "streamed", reps, seed=i))
                print(network, mode, i, json.dumps(runs[mode][-1]), flush=True)
        result[network] = {"runs": runs, "summary": summarize(runs)}
        print(network, json.dumps(result[network]["summary"], indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
