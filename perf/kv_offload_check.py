"""KV offload tiers on a device, in one process (issue 33): the demo model with a pool of a few
blocks, host memory (pinned on CUDA) and a disk directory behind it. A prompt's prefix blocks
are computed, evicted by other prompts, and must then be the very bytes host memory and disk
hold and, once the prompt comes again, the bytes loaded back into new pool blocks, counted as
prefix hits, with the same tokens. On CUDA this is the path where every copy is queued without
waiting and only ``KVTiers.settle`` waits for them. A second engine on the same directory (a
restart) must serve the prefix from disk. (``--ram-blocks 4``: the first load comes from disk
too.) Exit status 0 when all of that holds.

    python -m perf.kv_offload_check --device cuda        # a lent GPU machine
    python -m perf.kv_offload_check --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.kv_tiers import HOST
from pdserve.services.engine.kv_tiers.block_file import read_block
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.layout import prefix_block_hashes
from pdserve.shared.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(args: argparse.Namespace, disk: Path) -> LLMEngine:
    probe = EngineConfig(model="demo", device=args.device, dtype=args.dtype, num_kv_blocks=1)
    block = LLMEngine(probe).bytes_per_block
    cfg = EngineConfig(
        model="demo",
        device=args.device,
        dtype=args.dtype,
        block_size=16,
        num_kv_blocks=args.pool,
        kv_offload_ram_gib=args.ram_blocks * block / (1 << 30),
        kv_offload_disk=str(disk),
    )
    return LLMEngine(cfg)


def served(eng: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    eng.add_request("check", prompt, GREEDY)
    tokens, hit = [], None
    while eng.has_unfinished():
        result = eng.step()
        for out in result.outputs if result else ():
            tokens += out.new_token_ids
            hit = out.num_prefix_hit_tokens if hit is None else hit
    return tokens, hit or 0


def run(args: argparse.Namespace, disk: Path) -> dict:
    rng = random.Random(33)
    prompt = [rng.randrange(1, 250) for _ in range(72)]  # 4 full blocks of prefix, then 8
    fillers = [[rng.randrange(1, 250) for _ in range(60)] for _ in range(12)]
    eng = engine(args, disk)
    bm, raw, tiers = eng.block_manager, eng.offload.raw, eng.offload.tiers
    first = eng.generate([prompt], GREEDY)[0]
    hashes = prefix_block_hashes(prompt[:64], 16)
    computed = raw[[bm.hash_to_block[h] for h in hashes]].cpu()
    for i in range(0, len(fillers), 3):
        eng.generate(fillers[i : i + 3], GREEDY)
    eng.offload.flush()
    checks = {"evicted": not any(h in bm.hash_to_block for h in hashes)}
    on_disk = [
        read_block(tiers.disk.path(h), tiers.disk.layout, h, eng.bytes_per_block) for h in hashes
    ]
    checks["disk_bytes"] = all(
        torch.equal(torch.from_numpy(b.copy()), want)
        for b, want in zip(on_disk, computed, strict=True)
    )
    checks["host_bytes"] = all(
        torch.equal(tiers.host.slab[tiers.host.index[h]], want)
        for h, want in zip(hashes, computed, strict=True)
        if tiers.where(h) == HOST
    )
    tokens, hit = served(eng, prompt)
    checks["hit_64"] = hit == 64
    checks["same_tokens"] = tokens == first
    checks["loaded_bytes"] = torch.equal(raw[[bm.hash_to_block[h] for h in hashes]].cpu(), computed)
    stats = eng.offload.stats()
    eng.close()
    again = engine(args, disk)
    again.offload.flush()  # its start-up scan
    tokens, hit = served(again, prompt)
    restart = again.offload.stats()
    checks["restart_from_disk"] = hit == 64 and restart.disk_hits == 4 and tokens == first
    again.close()
    return {
        "device": args.device,
        "dtype": args.dtype,
        "checks": checks,
        "host_hits": stats.host_hits,
        "disk_hits": stats.disk_hits,
        "stored": stats.stored,
        "restart_disk_hits": restart.disk_hits,
        "ok": all(checks.values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pool", type=int, default=12, help="KV blocks of the device pool")
    ap.add_argument("--ram-blocks", type=int, default=64, help="blocks host memory holds")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    print("kv_offload_check", json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
