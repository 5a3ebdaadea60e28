"""A KV server in its own process, for tests that kill or freeze the prefill side.

python -m tests.integration.kv_peer BLOCKS...   prints one JSON line {address, token, expires}
then serves the lease on a cache filled by ``peer_cache()`` until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from pdserve.shared.kv.transfer import KVServer, LeaseTable

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
NUM_BLOCKS = 32


def fingerprint() -> dict:
    return {
        "model": "tiny",
        "dtype": "float32",
        "block_size": BLOCK,
        "num_layers": LAYERS,
        "num_kv_heads": HEADS,
        "head_dim": DIM,
    }


def peer_cache() -> torch.Tensor:
    return torch.randn(
        (NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS, DIM), generator=torch.Generator().manual_seed(7)
    )


async def serve(blocks: list[int], host: str) -> None:
    leases = LeaseTable(lambda rid: None)
    server = KVServer(peer_cache(), fingerprint(), leases, host=host)
    await server.start()
    lease = leases.add("r1", blocks, len(blocks) * BLOCK, ttl=300)
    line = {"address": server.address, "token": lease.token, "expires": lease.expires}
    print(json.dumps(line), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    args = sys.argv[1:]
    host = "127.0.0.1"
    if args[:1] == ["--host"]:
        host, args = args[1], args[2:]
    asyncio.run(serve([int(b) for b in args], host))
