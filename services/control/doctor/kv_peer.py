"""Two-process KV transfer measurement: pdserve's pull against a raw UCX send of the same bytes.

Shared by ``perf/kv_bench.py`` (the benchmark) and ``pdserve doctor`` (the transport check), so
both measure exactly the same thing. As in serving, a prefill-side process holds a block-major
KV cache ``[blocks, layers, 2, block_size, kv_heads, head_dim]`` behind a real ``KVServer`` (one
lease covers every block) plus a raw sender; the decode side - the calling process - has a real
``KVClient`` and its own cache. For each size and block pattern the two ways to move the bytes
alternate (ABBA order, so neither always runs on a warmer cache):

- **pull**: ``KVClient.pull`` of N blocks - control round trip, lease and fingerprint checks,
  one UCX message per run of blocks consecutive on both sides - exactly what a decode worker does.
- **raw**: over the same kind of endpoints (UCX worker addresses, fixed tags), a 16-byte request,
  then one receive of the same number of bytes, sent by one send straight from the prefill cache
  into the decode cache: the best UCX can do with those bytes, plus the request round trip any
  pull needs to start.

Every UCX operation goes through ``pdserve.shared.kv.ucx_progress`` (ucxx's own ``ep.send``/``recv`` spin
on ``sleep(0)``, which would tax the raw baseline with the busy-waiting a worker never does).

Patterns: ``contiguous`` (blocks 0..N-1 on both sides: one message) and ``fragmented`` (a random
permutation on each side, as a block manager hands out blocks after churn: one message per block).

    python -m pdserve.services.control.doctor.kv_peer --serve BLOCKS --geometry JSON [--host H]   (prefill side)
    python -m pdserve.services.control.doctor.kv_peer --measure --result FILE [--sizes-mib ...]  (decode side, doctor)
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.services.control.doctor.kv_peer_result import CaseResult
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv import ucx_progress
from pdserve.shared.kv.transfer import KVClient, KVServer, LeaseTable, block_runs, parse_address

LEASE_ID = "kv-peer-test"
PATTERNS = ("contiguous", "fragmented")
READY_PREFIX = "kv-peer-test ready "
RAW_TAG = 0x7261_7700_0000_0000  # the raw baseline's requests (and +1: the hello)
RAW_REPLY_TAG = 0x7261_7700_0000_0010
TOKEN_ENV = "PDSERVE_KV_PEER_TOKEN"


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

    def blocks_for(self, size_mib: float) -> int:
        return max(1, round(size_mib * (1 << 20) / self.block_bytes))

    def fingerprint(self) -> dict[str, object]:
        return {
            "model": "kv-peer-test",
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


def flush_c_stdio() -> None:
    """Flush C stdio buffers: UCX writes its log (``UCX_LOG_FILE``, ``UCX_PROTO_INFO`` tables)
    through them, and a process that leaves with ``os._exit`` would lose what is buffered."""
    ctypes.CDLL(None).fflush(None)


# ---------------------------------------------------------------------------------------------
# prefill side (child process)


async def serve(geometry: Geometry, num_blocks: int, token: str, host: str) -> None:
    import ucxx
    from ucxx._lib.libucxx import UCXAddress

    cache = geometry.empty_cache(num_blocks)
    # block b holds the word b everywhere, so the puller can check which block landed where
    block_words(cache).copy_(torch.arange(num_blocks, dtype=torch.int16)[:, None])
    leases = LeaseTable(on_free=lambda bus_id: None)
    leases.add(LEASE_ID, list(range(num_blocks)), num_blocks * geometry.block_size, ttl=1e9)
    leases.leases[LEASE_ID].token = token
    server = KVServer(cache, geometry.fingerprint(), leases, host=host)
    await server.start()

    async def raw_sender() -> None:
        # hello: the decode side's worker address; then [bytes wanted, reply tag] per request
        size = np.empty(1, dtype=np.uint64)
        await ucx_progress.worker_recv(size, RAW_TAG)
        address = np.empty(int(size[0]), dtype=np.uint8)
        await ucx_progress.worker_recv(address, RAW_TAG + 1)
        ep = await ucxx.create_endpoint_from_worker_address(UCXAddress.create_from_buffer(address))
        header = np.empty(2, dtype=np.uint64)
        while True:
            await ucx_progress.worker_recv(header, RAW_TAG)
            await ucx_progress.send(ep, flat_bytes(cache, int(header[0])), int(header[1]))

    raw = asyncio.create_task(raw_sender())
    print(READY_PREFIX + json.dumps({"pull_address": server.address}), flush=True)
    # run until the parent closes our stdin (or kills us)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    raw.cancel()
    await server.stop()


# ---------------------------------------------------------------------------------------------
# decode side (the calling process)


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
    def __init__(
        self, geometry: Geometry, num_blocks: int, token: str, ready: dict, host: str
    ) -> None:
        self.geometry = geometry
        self.token = token
        self.address = ready["pull_address"]
        self.cache = geometry.empty_cache(num_blocks)
        self.client = KVClient(self.cache, geometry.fingerprint(), geometry.block_size, host=host)
        self.raw_ep: Any = None

    async def connect(self) -> None:
        import ucxx
        from ucxx._lib.libucxx import UCXAddress

        mine = np.frombuffer(self.client.own_address(), dtype=np.uint8)  # configures UCX first
        _, server = parse_address(self.address)
        self.raw_ep = await ucxx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(np.frombuffer(server, dtype=np.uint8).copy())
        )
        await ucx_progress.send(self.raw_ep, np.array([mine.size], dtype=np.uint64), RAW_TAG)
        await ucx_progress.send(self.raw_ep, mine.copy(), RAW_TAG + 1)

    async def pull(self, src: list[int], dst: list[int]) -> float:
        handle = KVHandle(
            worker_id="kv-peer-test",
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
        got = ucx_progress.recv(self.raw_ep, flat_bytes(self.cache, num_bytes), RAW_REPLY_TAG)
        # posted before the request, as in a pull
        header = np.array([num_bytes, RAW_REPLY_TAG], dtype=np.uint64)
        await ucx_progress.send(self.raw_ep, header, RAW_TAG)
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
        n = self.geometry.blocks_for(size_mib)
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
    geometry: Geometry,
    sizes_mib: list[float],
    reps: int,
    warmup: int,
    seed: int = 0,
    patterns: tuple[str, ...] = PATTERNS,
    host: str = "127.0.0.1",
    on_case: Callable[[CaseResult], None] | None = None,
    peer_prefix: Sequence[str] = (),
    peer_host: str | None = None,
) -> list[CaseResult]:
    """Start the prefill side in a child process and measure every size and pattern. The child
    runs under ``peer_prefix`` (``ip netns exec NAME``: on another host) with ``--host
    peer_host`` (default ``host``)."""
    num_blocks = geometry.blocks_for(max(sizes_mib))
    token = secrets.token_urlsafe(16)
    child = subprocess.Popen(
        [
            *peer_prefix,
            sys.executable,
            "-m",
            "pdserve.services.control.doctor.kv_peer",
            "--serve",
            str(num_blocks),
            "--geometry",
            json.dumps(asdict(geometry)),
            "--host",
            peer_host or host,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, TOKEN_ENV: token, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        text=True,
    )
    try:
        side = DecodeSide(geometry, num_blocks, token, read_ready(child), host)
        await side.connect()
        rng = random.Random(seed)
        results = []
        try:
            for size in sizes_mib:
                for pattern in patterns:
                    case = await side.run_case(size, pattern, reps, warmup, rng)
                    if on_case is not None:
                        on_case(case)
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


# ---------------------------------------------------------------------------------------------
# command line: the two ends as child processes


def _measure_to_file(args: argparse.Namespace) -> int:
    """Decode side for ``pdserve doctor``: cases and UCX facts to ``--result`` as JSON."""
    from pdserve.shared.kv import ucx_check

    outcome: dict[str, Any] = {}
    try:
        cases = asyncio.run(
            measure(
                Geometry(), args.sizes_mib, args.reps, args.warmup, 0, ("contiguous",), args.host
            )
        )
        outcome["cases"] = [c.summary() for c in cases]
    except Exception as exc:  # reported by the doctor as a failed check, with the reason
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    try:
        outcome["ucx"] = ucx_check.ucx_facts()
    except Exception as exc:
        outcome["ucx_error"] = f"{type(exc).__name__}: {exc}"
    Path(args.result).write_text(json.dumps(outcome))
    return 0 if "cases" in outcome else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.services.control.doctor.kv_peer")
    p.add_argument("--serve", type=int, help="prefill side: serve this many blocks")
    p.add_argument("--geometry", default="{}", help="Geometry fields as JSON")
    p.add_argument("--host", default="127.0.0.1", help="--ucx-host of both ends")
    p.add_argument("--measure", action="store_true", help="decode side, for the doctor")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--result", help="where --measure writes its JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.serve is not None:
        geometry = Geometry(**json.loads(args.geometry))
        asyncio.run(serve(geometry, args.serve, os.environ[TOKEN_ENV], args.host))
        rc = 0
    elif args.measure and args.result:
        rc = _measure_to_file(args)
    else:
        p.error("give --serve BLOCKS or --measure --result FILE")
    flush_c_stdio()
    sys.stdout.flush()
    os._exit(rc)  # skip UCX's and torch's teardown, which takes seconds and adds nothing


if __name__ == "__main__":
    sys.exit(main())
