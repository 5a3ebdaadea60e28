"""A tensor-parallel rank other than 0: ``python -m pdserve.services.engine.rank_process SPEC``.

It builds its shard of the model and KV cache exactly as rank 0 builds its own
(``model_setup.py``), then runs every step rank 0 sends it, until rank 0 says stop or goes away.
It never schedules, samples or speaks NATS.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.services.engine.loader import resolve_device_dtype
from pdserve.services.engine.lora.setup import build_follower_slots
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.model_runner import ModelRunner
from pdserve.services.engine.model_setup import build_rank_model, kv_parts
from pdserve.services.engine.parallel.group import RankSpec, join_group, rank_device
from pdserve.services.engine.parallel.kv_agent import KVAgent
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.parallel.tier_mirror import RankTiers
from pdserve.shared.config import EngineConfig

# Its module's name spelled out: the process runs it as __main__.
log = logging.getLogger("pdserve.services.engine.rank_process")
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to end this process when rank 0 does, however rank 0 ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed control connection still ends the loop


def serve(spec: RankSpec) -> None:
    die_with_parent()
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    config = EngineConfig(**spec.config)
    torch.set_num_threads(spec.threads)
    conn = Connection(socket.create_connection(tuple(spec.control)).detach())
    conn.send((spec.key, spec.rank, "step"))
    kv_conn = Connection(socket.create_connection(tuple(spec.control)).detach())
    kv_conn.send((spec.key, spec.rank, "kv"))
    device, dtype = resolve_device_dtype(spec.device, config.dtype)
    device = rank_device(device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group, _store = join_group(device, spec.rank, spec.size, spec.init_port)
    shard = Shard(
        rank=spec.rank, size=spec.size, group=group, vocab_parallel=config.tp_lm_head == "vocab"
    )
    model_dir = Path(spec.model_dir)
    try:
        built = build_rank_model(
            config, ModelConfig.from_dir(model_dir), model_dir, device, dtype, shard
        )
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))
        raise
    runner = ModelRunner(built.model, built.kv_cache, config.block_size, device)
    lora = build_follower_slots(config, built.model)  # rank 0's adapter slots, this rank's cut
    agent = KVAgent(
        conn=kv_conn,
        kv_cache=built.kv_cache,
        heads=shard.kv_heads(built.model.cfg),
        split=kv_parts(built.kv_spec),
        block_size=config.block_size,
    )
    agent.start()
    tiers = RankTiers(built.kv_cache)  # this rank's shard of the KV offload tiers
    conn.send(
        (
            "ready",
            {
                "rank": spec.rank,
                "pid": os.getpid(),
                "num_blocks": built.num_blocks,
                "block_bytes": built.kv_spec.bytes_per_block,
            },
        )
    )
    with torch.inference_mode():
        while True:
            try:
                kind, body = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone: so is this worker
            if kind == "stop":
                return
            if kind == "tier":  # answered: rank 0 waits until the copies are done
                conn.send(("tier", tiers.apply(body)))
                continue
            runner.copy_blocks(body.block_copies)
            if lora is not None and body.lora_loads:
                lora.apply(body.lora_loads)
            runner.follow_logits(body, runner.forward(body))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    spec = RankSpec(**json.loads(argv[0]))
    serve(spec)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of torch and gloo (seconds, and nothing to flush)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
