"""What ``--kv-checksum`` costs a KV pull: the same pulls with the check on and off, side by side.

Two processes, as in serving: a child holds a block-major KV cache (``Geometry``, Llama-3.2-1B
in bf16 by default: 512 KiB per block) behind a real ``KVServer`` with ``checksum=True`` and
one lease over all of it; this process pulls from it with two real ``KVClient``s over UCX, one
verifying (``checksum=True``) and one not, alternating ABBA per size so that drift on a shared
machine hits both alike. The check's cost on the decode side is hashing what landed (xxh3-64
per block and KV head, off the event loop) plus the hashes' message; the prefill side's hashing
happens once per lease, in a thread, when the lease is added: it is timed here separately
(``lease_hash_gbps``: bytes hashed per second by one thread).

    python -m perf.kv_checksum_bench [--sizes-mib 1 8 64] [--reps 11] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.services.control.doctor.kv_peer import Geometry
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.transfer import KVClient, KVServer, LeaseTable
from pdserve.shared.kv.transfer.checksum import KVHasher
from pdserve.shared.kv.transfer.heads import HeadSlicer


@dataclass
class Case:
    size_mib: float
    blocks: int
    off_gbps: float  # median pull bandwidth without the check
    on_gbps: float  # ... with it
    ratio: float  # on / off
    verify_ms: float  # median decode-side hashing per pull
    lease_hash_gbps: float  # prefill side: one thread hashing a lease's blocks


async def serve(geometry: Geometry, num_blocks: int) -> None:
    """The child: a checksumming server with one lease over every block; prints its handle."""
    cache = torch.randn(
        (
            num_blocks,
            geometry.num_layers,
            2,
            geometry.block_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
    ).to(geometry.torch_dtype)
    leases = LeaseTable(lambda _: None)
    server = KVServer(cache, geometry.fingerprint(), leases, checksum=True)
    await server.start()
    lease = leases.add("bench", list(range(num_blocks)), num_blocks * geometry.block_size, 3600)
    print(
        json.dumps({"address": server.address, "token": lease.token, "expires": lease.expires}),
        flush=True,
    )
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
    await server.stop()


def lease_hash_gbps(geometry: Geometry, blocks: int) -> float:
    cache = torch.randn(
        (
            blocks,
            geometry.num_layers,
            2,
            geometry.block_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
    ).to(geometry.torch_dtype)
    hasher = KVHasher(cache, HeadSlicer(cache, geometry.fingerprint(), None, None))
    heads = (0, geometry.num_kv_heads)
    hasher.hash_blocks(range(blocks), heads)  # warm
    t0 = time.perf_counter()
    hasher.hash_blocks(range(blocks), heads)
    return blocks * geometry.block_bytes / (time.perf_counter() - t0) / 1e9


async def measure(geometry: Geometry, sizes: list[float], reps: int) -> list[Case]:
    num_blocks = geometry.blocks_for(max(sizes))
    child = subprocess.Popen(
        [sys.executable, "-m", "perf.kv_checksum_bench", "--serve", str(num_blocks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )
    try:
        info = json.loads(child.stdout.readline())
        shape = (
            num_blocks,
            geometry.num_layers,
            2,
            geometry.block_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        fp = geometry.fingerprint()
        clients = {
            checked: KVClient(
                torch.zeros(shape, dtype=geometry.torch_dtype),
                fp,
                geometry.block_size,
                checksum=checked,
            )
            for checked in (False, True)
        }
        out = []
        for size in sizes:
            n = geometry.blocks_for(size)
            handle = KVHandle(
                "bench",
                info["address"],
                list(range(n)),
                n * geometry.block_size,
                fp,
                info["expires"],
                info["token"],
            )
            times: dict[bool, list[float]] = {False: [], True: []}
            verify: list[float] = []
            for checked in (False, True):  # warm both endpoints
                await clients[checked].pull("bench", handle, list(range(n)))
            for rep in range(reps):
                order = (False, True) if rep % 2 == 0 else (True, False)  # ABBA
                for checked in order:
                    t0 = time.perf_counter()
                    stats = await clients[checked].pull("bench", handle, list(range(n)))
                    times[checked].append(time.perf_counter() - t0)
                    if checked:
                        verify.append(stats.checksum_seconds)
            nbytes = n * geometry.block_bytes
            off = nbytes / statistics.median(times[False]) / 1e9
            on = nbytes / statistics.median(times[True]) / 1e9
            case = Case(
                size,
                n,
                off,
                on,
                on / off,
                statistics.median(verify) * 1e3,
                lease_hash_gbps(geometry, n),
            )
            print(
                f"  {size:6g} MiB  off {off:6.2f} GB/s  on {on:6.2f} GB/s  ratio "
                f"{case.ratio:.2f}  verify {case.verify_ms:6.2f} ms  lease hashing "
                f"{case.lease_hash_gbps:.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )
            out.append(case)
        for client in clients.values():
            await client.close()
        return out
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child's side
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    geometry = Geometry()
    if args.serve:
        asyncio.run(serve(geometry, args.serve))
        return 0
    print(
        f"KV pull with --kv-checksum on vs off, {geometry}, median of {args.reps} ABBA reps",
        file=sys.stderr,
    )
    cases = asyncio.run(measure(geometry, args.sizes_mib, args.reps))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "workload": f"{geometry}, contiguous blocks, {args.reps} ABBA repetitions",
                    "cases": [asdict(c) for c in cases],
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
