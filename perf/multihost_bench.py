"""The gateway's cross-host hops, measured on the network-namespace topology of
``tests/multihost`` (needs root and ``ip netns``).

The same stack - a 3-node NATS cluster, gateway, one prefill and one decode worker, each process
on its own node - runs twice, one after the other: every process on loopback in this namespace,
then each role in its own namespace ("host") behind veth pairs on one bridge. Requests go one at
a time; TPOT (time per output token after the first, through HTTP) is the per-token cost, so the
difference is what the bridge hops add to every token (decode worker -> its NATS node -> route ->
the gateway's node -> gateway -> client). The namespace network is virtual: read the ratio.

KV pull bandwidth between namespaces is ``perf/netns_kv_bench.py``'s: here the KV crosses the
bridge over UCX TCP on the hosts' 198.18 addresses, and a failed pull fails its request.

    python -m perf.multihost_bench --requests 8 --tokens 64 --json perf/results/multihost_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from pdserve.services.control.processes import NatsCluster
from tests.integration.migration_stack import worker_blocks
from tests.integration.stack import free_port, start_service, stop_all
from tests.multihost import netns
from tests.multihost.hosts import namespace_stack

WORKER = {
    "model": "demo",
    "num_kv_blocks": 256,
    "heartbeat_seconds": 0.5,
    "kv_failure_policy": "fail",
    "local_prefill_threshold": 0,
}
PROMPT = "Measure the cost of every hop between the hosts, token by token. " * 3


async def tpot(base: str, tokens: int) -> float:
    """Seconds per output token after the first, of one streamed greedy completion."""
    body = {
        "model": "demo",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps = []
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/v1/models") as r:
            body["model"] = (await r.json())["data"][0]["id"]
        async with session.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.perf_counter())
    assert len(stamps) >= tokens // 2, f"only {len(stamps)} chunks"
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def measure(base: str, requests: int, tokens: int) -> list[float]:
    await tpot(base, 8)  # warm-up
    return [await tpot(base, tokens) for _ in range(requests)]


def wait_ready(base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while set(worker_blocks(base)) != {"p0", "d0"}:
        if time.monotonic() > deadline:
            raise TimeoutError("stack did not come up")
        time.sleep(0.2)


def run_loopback(logs: Path, requests: int, tokens: int) -> list[float]:
    cluster = NatsCluster.local(3, logs)
    cluster.start()
    port = free_port()
    children = []
    try:
        children.append(
            start_service("gateway", cluster.client_url(0), logs, options={"port": port})
        )
        children.append(
            start_service(
                "prefill", cluster.client_url(1), logs, options={**WORKER, "worker_id": "p0"}
            )
        )
        children.append(
            start_service(
                "decode", cluster.client_url(2), logs, options={**WORKER, "worker_id": "d0"}
            )
        )
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        return asyncio.run(measure(base, requests, tokens))
    finally:
        stop_all(children)
        cluster.stop()


def run_namespaces(logs: Path, requests: int, tokens: int) -> list[float]:
    with namespace_stack(logs, WORKER, WORKER, {"model": "demo"}) as stack:
        return asyncio.run(measure(stack.base_url, requests, tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"multihost_bench: {reason}")
    logs = Path(tempfile.mkdtemp(prefix="pdserve-multihost-bench-"))
    for sub in ("loopback", "netns"):
        (logs / sub).mkdir()
    loop = run_loopback(logs / "loopback", args.requests, args.tokens)
    spread = run_namespaces(logs / "netns", args.requests, args.tokens)
    p50_loop, p50_ns = statistics.median(loop) * 1e3, statistics.median(spread) * 1e3
    result = {
        "requests": args.requests,
        "tokens": args.tokens,
        "tpot_ms_loopback": [round(x * 1e3, 3) for x in loop],
        "tpot_ms_namespaces": [round(x * 1e3, 3) for x in spread],
        "p50_tpot_ms_loopback": round(p50_loop, 3),
        "p50_tpot_ms_namespaces": round(p50_ns, 3),
        "cross_host_ms_per_token": round(p50_ns - p50_loop, 3),
        "ratio_namespaces_to_loopback": round(p50_ns / p50_loop, 3),
        "logs": str(logs),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
