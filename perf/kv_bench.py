"""KV transfer bandwidth: pdserve's pull (shared/kv_transfer.py) against raw ucxx, same bytes.

Two processes, as in serving: a prefill-side process holds a block-major KV cache
``[blocks, layers, 2, block_size, kv_heads, head_dim]`` behind a real ``KVServer`` (one lease
covers every block) and, on a second ucxx listener, a raw sender; this process is the decode side
with a real ``KVClient`` and its own cache. For each size and block pattern the two ways to move
the bytes alternate (ABBA order, so neither always runs on a warmer cache) and the medians are
compared:

- **pull**: ``KVClient.pull`` of N blocks, control round trip, lease and fingerprint checks, one
  UCX message per run of blocks consecutive on both sides - exactly what a decode worker does.
- **raw**: over the same kind of endpoints (UCX worker addresses, fixed tags), a 16-byte
  request, then one receive of the same number of bytes, sent by one ``ep.send`` straight from
  the prefill cache into the decode cache. The best ucxx can do with those bytes; the request
  round trip is what any pull needs to start.

Patterns: ``contiguous`` (blocks 0..N-1 on both sides: one message) and ``fragmented`` (a random
permutation of 0..N-1 on each side, as a block manager hands out blocks after churn: about one
message per block). Target: pull >= 0.8x raw.

    python -m perf.kv_bench [--sizes-mib 1 8 64 256] [--reps 15] [--json perf/results/kv_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.kv_transfer import KVClient, KVServer, LeaseTable, block_runs, parse_address
from shared.protocol import KVHandle

TARGET_RATIO = 0.8
LEASE_ID = "kv-bench"
PATTERNS = ("contiguous", "fragmented")
READY_PREFIX = "kv-bench ready "
RAW_TAG = 0x7261_7700_0000_0000  # the raw baseline's requests (and +1: the hello)
RAW_REPLY_TAG = 0x7261_7700_0000_0010


@dataclass
class Geometry:
    """Cache shape; the default is Llama-3.2-1B in bf16 (16 layers, 8 KV heads, head dim 64,
    16-token blocks: 32 KiB per token, 512 KiB per block)."""

    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        elem = torch.empty(0, dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def fingerprint(self) -> dict[str, object]:
        return {
            "model": "kv-bench",
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }

    def empty_cache(self, num_blocks: int) -> torch.Tensor:
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.torch_dtype)


def block_words(cache: torch.Tensor) -> torch.Tensor:
    """The cache as int16 words, one row per block (bf16/fp16 are 2 bytes; fp32 gives 2 words)."""
    return cache.view(cache.shape[0], -1).view(torch.int16)


def flat_bytes(cache: torch.Tensor, num_bytes: int) -> np.ndarray:
    """The first ``num_bytes`` of the cache's memory as a numpy view (no copy)."""
    return cache.reshape(-1).view(torch.uint8)[:num_bytes].numpy()


# ---------------------------------------------------------------------------------------------
# prefill side (child process)


async def serve(geometry: Geometry, num_blocks: int, token: str) -> None:
    import ucxx
    from ucxx._lib.libucxx import UCXAddress

    cache = geometry.empty_cache(num_blocks)
    # block b holds the word b everywhere, so the puller can check which block landed where
    block_words(cache).copy_(torch.arange(num_blocks, dtype=torch.int16)[:, None])
    leases = LeaseTable(on_free=lambda request_id: None)
    leases.add(LEASE_ID, list(range(num_blocks)), num_blocks * geometry.block_size, ttl=1e9)
    leases.leases[LEASE_ID].token = token
    server = KVServer(cache, geometry.fingerprint(), leases)
    await server.start()

    async def raw_sender() -> None:
        # hello: the decode side's worker address; then [bytes wanted, reply tag] per request
        size = np.empty(1, dtype=np.uint64)
        await ucxx.recv(size, tag=RAW_TAG)
        address = np.empty(int(size[0]), dtype=np.uint8)
        await ucxx.recv(address, tag=RAW_TAG + 1)
        ep = await ucxx.create_endpoint_from_worker_address(UCXAddress.create_from_buffer(address))
        header = np.empty(2, dtype=np.uint64)
        while True:
            await ucxx.recv(header, tag=RAW_TAG)
            await ep.send(flat_bytes(cache, int(header[0])), tag=int(header[1]), force_tag=True)

    raw = asyncio.create_task(raw_sender())
    print(READY_PREFIX + json.dumps({"pull_address": server.address}), flush=True)
    # run until the parent closes our stdin (or kills us)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    raw.cancel()
    await server.stop()


# ---------------------------------------------------------------------------------------------
# decode side (this process)


@dataclass
class CaseResult:
    size_mib: float
    pattern: str
    num_blocks: int
    num_bytes: int
    messages: int
    pull_seconds: list[float] = field(default_factory=list)
    raw_seconds: list[float] = field(default_factory=list)

    @property
    def pull_median(self) -> float:
        return statistics.median(self.pull_seconds)

    @property
    def raw_median(self) -> float:
        return statistics.median(self.raw_seconds)

    @property
    def pull_gbps(self) -> float:
        return self.num_bytes / self.pull_median / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.num_bytes / self.raw_median / 1e9

    @property
    def ratio(self) -> float:
        return self.raw_median / self.pull_median

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "pull_median_s": self.pull_median,
            "raw_median_s": self.raw_median,
            "pull_gbps": self.pull_gbps,
            "raw_gbps": self.raw_gbps,
            "ratio": self.ratio,
            "meets_target": self.ratio >= TARGET_RATIO,
        }


def block_ids(pattern: str, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    # random ids on both sides, redrawn until no two pairs coalesce: one message per block
    src, dst = list(range(n)), list(range(n))
    for _ in range(1000):
        rng.shuffle(src)
        rng.shuffle(dst)
        if len(block_runs(src, dst)) == n:
            break
    return src, dst


class DecodeSide:
    def __init__(self, geometry: Geometry, num_blocks: int, token: str, ready: dict) -> None:
        self.geometry = geometry
        self.token = token
        self.address = ready["pull_address"]
        self.cache = geometry.empty_cache(num_blocks)
        self.client = KVClient(self.cache, geometry.fingerprint(), geometry.block_size)
        self.raw_ep: Any = None

    async def connect(self) -> None:
        import ucxx
        from ucxx._lib.libucxx import UCXAddress

        mine = np.frombuffer(self.client.own_address(), dtype=np.uint8)  # configures UCX first
        _, server = parse_address(self.address)
        self.raw_ep = await ucxx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(np.frombuffer(server, dtype=np.uint8).copy())
        )
        await self.raw_ep.send(np.array([mine.size], dtype=np.uint64), tag=RAW_TAG, force_tag=True)
        await self.raw_ep.send(mine, tag=RAW_TAG + 1, force_tag=True)

    async def pull(self, src: list[int], dst: list[int]) -> float:
        handle = KVHandle(
            worker_id="prefill-bench",
            ucx_address=self.address,
            block_ids=src,
            num_tokens=len(src) * self.geometry.block_size,
            fingerprint=self.geometry.fingerprint(),
            lease_expires=time.time() + 3600,
            token=self.token,
        )
        t0 = time.perf_counter()
        await self.client.pull(LEASE_ID, handle, dst)
        return time.perf_counter() - t0

    async def raw(self, num_bytes: int) -> float:
        t0 = time.perf_counter()
        got = asyncio.ensure_future(
            self.raw_ep.recv(flat_bytes(self.cache, num_bytes), tag=RAW_REPLY_TAG, force_tag=True)
        )
        await asyncio.sleep(0)  # the receive is posted before the request, as in a pull
        header = np.array([num_bytes, RAW_REPLY_TAG], dtype=np.uint64)
        await self.raw_ep.send(header, tag=RAW_TAG, force_tag=True)
        await got
        return time.perf_counter() - t0

    def check_pulled(self, src: list[int], dst: list[int]) -> None:
        words = block_words(self.cache)
        expected = torch.tensor(src, dtype=torch.int16)[:, None]
        if not torch.equal(words[dst], expected.expand(-1, words.shape[1])):
            raise AssertionError("pulled blocks do not hold the source blocks' bytes")

    async def run_case(
        self, size_mib: float, pattern: str, reps: int, warmup: int, rng: random.Random
    ) -> CaseResult:
        n = max(1, round(size_mib * (1 << 20) / self.geometry.block_bytes))
        src, dst = block_ids(pattern, n, rng)
        num_bytes = n * self.geometry.block_bytes
        result = CaseResult(
            size_mib=num_bytes / (1 << 20),
            pattern=pattern,
            num_blocks=n,
            num_bytes=num_bytes,
            messages=len(block_runs(src, dst)),
        )
        self.cache.zero_()
        await self.pull(src, dst)
        self.check_pulled(src, dst)  # the timed pulls move real, correctly placed bytes
        for i in range(warmup + reps):
            first_pull = i % 4 in (0, 3)  # ABBA
            if first_pull:
                p = await self.pull(src, dst)
                r = await self.raw(num_bytes)
            else:
                r = await self.raw(num_bytes)
                p = await self.pull(src, dst)
            if i >= warmup:
                result.pull_seconds.append(p)
                result.raw_seconds.append(r)
        return result

    async def close(self) -> None:
        await self.client.close()
        if self.raw_ep is not None:
            self.raw_ep.abort()


def read_ready(child: subprocess.Popen) -> dict:
    """The prefill side's ready line (other libraries may print before it)."""
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(READY_PREFIX):
            return json.loads(line.removeprefix(READY_PREFIX))
    raise RuntimeError(f"prefill-side process exited with {child.wait()}")


async def measure(
    geometry: Geometry, sizes_mib: list[float], reps: int, warmup: int, seed: int
) -> list[CaseResult]:
    num_blocks = max(1, round(max(sizes_mib) * (1 << 20) / geometry.block_bytes))
    token = secrets.token_urlsafe(16)
    child = subprocess.Popen(
        [sys.executable, "-m", "perf.kv_bench", "--serve", str(num_blocks),
         "--geometry", json.dumps(asdict(geometry))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PDSERVE_KV_BENCH_TOKEN": token, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        text=True,
    )  # fmt: skip
    try:
        side = DecodeSide(geometry, num_blocks, token, read_ready(child))
        await side.connect()
        rng = random.Random(seed)
        results = []
        try:
            for size in sizes_mib:
                for pattern in PATTERNS:
                    case = await side.run_case(size, pattern, reps, warmup, rng)
                    print(
                        f"  {case.size_mib:8.1f} MiB {pattern:10s} pull {case.pull_gbps:6.2f} GB/s"
                        f"  raw {case.raw_gbps:6.2f} GB/s  ratio {case.ratio:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.append(case)
        finally:
            await side.close()
        return results
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def markdown(results: list[CaseResult], reps: int) -> str:
    lines = [
        f"KV pull vs raw ucxx (median of {reps} interleaved repetitions; "
        f"target >= {TARGET_RATIO}x)",
        "",
        "| size | pattern | blocks | messages | pull GB/s | raw GB/s | ratio | target |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in results:
        lines.append(
            f"| {c.size_mib:g} MiB | {c.pattern} | {c.num_blocks} | {c.messages} "
            f"| {c.pull_gbps:.2f} | {c.raw_gbps:.2f} | {c.ratio:.2f}x "
            f"| {'met' if c.ratio >= TARGET_RATIO else 'MISSED'} |"
        )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import ucxx

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ucxx": getattr(ucxx, "__version__", "unknown"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.kv_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per case")
    p.add_argument("--seed", type=int, default=0, help="seed of the fragmented block ids")
    p.add_argument("--num-layers", type=int, default=Geometry.num_layers)
    p.add_argument("--num-kv-heads", type=int, default=Geometry.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=Geometry.head_dim)
    p.add_argument("--block-size", type=int, default=Geometry.block_size)
    p.add_argument("--dtype", default=Geometry.dtype, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # prefill-side child: blocks
    p.add_argument("--geometry", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    if args.serve is not None:
        geometry = Geometry(**json.loads(args.geometry))
        asyncio.run(serve(geometry, args.serve, os.environ["PDSERVE_KV_BENCH_TOKEN"]))
        return 0

    geometry = Geometry(
        args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, args.dtype
    )
    print(
        f"KV block: {geometry.block_bytes / 1024:g} KiB ({asdict(geometry)})",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    results = asyncio.run(measure(geometry, args.sizes_mib, args.reps, args.warmup, args.seed))
    seconds = time.perf_counter() - t0
    table = markdown(results, args.reps)
    print(table)
    met = all(c.ratio >= TARGET_RATIO for c in results)
    missed = sum(c.ratio < TARGET_RATIO for c in results)
    verdict = "met in every case" if met else f"MISSED in {missed} of {len(results)} cases"
    print(f"\ntarget {TARGET_RATIO}x {verdict}; {seconds:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": "python -m perf.kv_bench " + " ".join(argv or sys.argv[1:]),
            "geometry": asdict(geometry),
            "block_bytes": geometry.block_bytes,
            "reps": args.reps,
            "warmup": args.warmup,
            "target_ratio": TARGET_RATIO,
            "target_met": met,
            "seconds": seconds,
            "environment": environment(),
            "cases": [c.summary() for c in results],
            "markdown": table,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
