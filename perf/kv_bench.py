"""KV transfer bandwidth: pdserve's pull (shared/kv/transfer.py) against raw ucxx, same bytes.

Two processes, as in serving; the measurement itself lives in ``services/control/doctor/kv_peer.py`` (which
``pdserve doctor`` runs too): a prefill-side child holds a block-major KV cache behind a real
``KVServer`` and a raw sender, this process is the decode side with a real ``KVClient``. For each
size and block pattern, pull and raw alternate (ABBA) and the medians are compared:

- **pull**: ``KVClient.pull`` of N blocks, control round trip, lease and fingerprint checks, one
  UCX message per run of blocks consecutive on both sides - exactly what a decode worker does.
- **raw**: over the same kind of endpoints, a 16-byte request, then one send of the same number
  of bytes straight from the prefill cache into the decode cache: the best UCX can do with them.

Patterns: ``contiguous`` (blocks 0..N-1 on both sides: one message) and ``fragmented`` (a random
permutation of 0..N-1 on each side, as a block manager hands out blocks after churn: about one
message per block). Target: pull >= 0.8x raw. Beside them, a one-thread memcpy of each size in
this process (``torch`` ``copy_``, median): what one core can move, the yardstick for a pull
between two processes of one host, which goes over shared memory (issue 29).

    python -m perf.kv_bench [--sizes-mib 1 8 64 256] [--reps 15] [--json perf/results/kv_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pdserve.services.control.doctor.kv_peer import Geometry, measure
from pdserve.services.control.doctor.kv_peer_result import CaseResult
from pdserve.shared.kv import ucx_check

TARGET_RATIO = 0.8


def report_case(case: CaseResult) -> None:
    print(
        f"  {case.size_mib:8.1f} MiB {case.pattern:10s} pull {case.pull_gbps:6.2f} GB/s"
        f"  raw {case.raw_gbps:6.2f} GB/s  ratio {case.ratio:.2f}",
        file=sys.stderr,
        flush=True,
    )


MEMCPY_POOL_BYTES = 256 << 20  # well past this VM's 32 MiB L3, as a KV cache is


def memcpy_gbps(num_bytes: int, reps: int) -> float:
    """One thread copying ``num_bytes`` from one buffer to another, median GB/s. Each copy
    takes the next slice of a pool larger than the CPU's caches: a pull's blocks come from
    memory, and a 1 MiB copy repeated in place would run from L2 at ~4x the speed."""
    slices = max(2, MEMCPY_POOL_BYTES // num_bytes)
    src = torch.ones(slices * num_bytes, dtype=torch.uint8)
    dst = torch.ones_like(src)  # written once, so no copy below faults a page in
    times = []
    for i in range(reps):
        at = (i % slices) * num_bytes
        t0 = time.perf_counter()
        dst[at : at + num_bytes].copy_(src[at : at + num_bytes])
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9


def markdown(results: list[CaseResult], reps: int, memcpy: dict[int, float]) -> str:
    lines = [
        f"KV pull vs raw ucxx (median of {reps} interleaved repetitions; "
        f"target >= {TARGET_RATIO}x)",
        "",
        "| size | pattern | blocks | messages | pull GB/s | raw GB/s | ratio | target "
        "| memcpy GB/s | pull/memcpy |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for c in results:
        copy = memcpy[c.num_bytes]
        lines.append(
            f"| {c.size_mib:g} MiB | {c.pattern} | {c.num_blocks} | {c.messages} "
            f"| {c.pull_gbps:.2f} | {c.raw_gbps:.2f} | {c.ratio:.2f}x "
            f"| {'met' if c.ratio >= TARGET_RATIO else 'MISSED'} | {copy:.2f} "
            f"| {c.pull_gbps / copy:.2f}x |"
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
        "ucx_resources": ucx_check.process_transports(),  # what this process's UCX opened
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
    p.add_argument("--ucx-host", default="127.0.0.1", help="address both ends use for UCX")
    p.add_argument(
        "--peer-netns",
        help="run the prefill side in this network namespace (another host; perf/netns_kv_bench)",
    )
    p.add_argument("--peer-host", help="the prefill side's --ucx-host (default: --ucx-host)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    geometry = Geometry(
        args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, args.dtype
    )
    print(
        f"KV block: {geometry.block_bytes / 1024:g} KiB ({asdict(geometry)})",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    results = asyncio.run(
        measure(
            geometry,
            args.sizes_mib,
            args.reps,
            args.warmup,
            args.seed,
            host=args.ucx_host,
            on_case=report_case,
            peer_host=args.peer_host,
            peer_prefix=["ip", "netns", "exec", args.peer_netns] if args.peer_netns else (),
        )
    )
    seconds = time.perf_counter() - t0
    memcpy = {n: memcpy_gbps(n, args.reps) for n in sorted({c.num_bytes for c in results})}
    table = markdown(results, args.reps, memcpy)
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
            "cases": [
                {
                    **c.summary(),
                    "meets_target": c.ratio >= TARGET_RATIO,
                    "memcpy_gbps": memcpy[c.num_bytes],
                }
                for c in results
            ],
            "markdown": table,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
