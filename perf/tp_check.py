"""The engine's tensor-parallel path on one device, in one process (issue 28): an ``LLMEngine`` of
``--tensor-parallel-size N`` on ``--device``, a short greedy generate (``ignore_eos``, so every
prompt must come back with exactly ``--max-tokens`` tokens), and the layout fingerprint, whose
``tensor_parallel_size`` (``shared/kv/tp_layout.py`` TP_KEY) must be N. At N > 1 rank 0 starts
ranks 1..N-1 itself (NCCL on CUDA, a GPU each; gloo on CPU); every rank's pid is printed.

``--compare`` runs a TP 1 engine on the same prompts afterwards and reports how many output
tokens agree: in float32 all of them as a rule (an all-reduce sums in another order, which can
flip a near-tie), so it informs and never fails the check. Exit status: 0 when the fingerprint
and the outputs are right, 1 otherwise.

    python -m perf.tp_check --device cuda --tensor-parallel-size 1         # perf/gpu_check.sh
    python -m perf.tp_check --device cuda --tensor-parallel-size 2 --dtype float32 --compare
    python -m perf.tp_check --device cpu --tensor-parallel-size 2 --compare   # gloo, anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.tp_layout import TP_KEY
from pdserve.shared.sampling import SamplingParams


def prompts(count: int, length: int, vocab: int, seed: int = 28) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, min(vocab, 256)) for _ in range(length)] for _ in range(count)]


def engine(args: argparse.Namespace, tp: int) -> LLMEngine:
    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        num_kv_blocks=args.num_kv_blocks,
    )
    return LLMEngine(cfg)


def run(args: argparse.Namespace) -> dict:
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    eng = engine(args, args.tensor_parallel_size)
    try:
        batch = prompts(args.prompts, args.prompt_tokens, eng.model_config.vocab_size)
        start = time.perf_counter()
        first = eng.generate(batch, greedy)  # compiles the kernels on first use
        cold = time.perf_counter() - start
        start = time.perf_counter()
        again = eng.generate(batch, greedy)
        warm = time.perf_counter() - start
        fingerprint = eng.layout_fingerprint()
        others = [r["pid"] for r in eng.ranks.ready] if eng.ranks is not None else []
        pids = [os.getpid(), *others]
        out = {
            "device": str(eng.device),
            "device_name": torch.cuda.get_device_name(eng.device)
            if eng.device.type == "cuda"
            else "cpu",
            "dtype": str(eng.dtype).removeprefix("torch."),
            "tensor_parallel_size": args.tensor_parallel_size,
            "fingerprint": fingerprint,
            "rank_pids": pids,
            "cold_seconds": round(cold, 3),
            "warm_seconds": round(warm, 3),
            "warm_tokens_per_second": round(len(batch) * args.max_tokens / warm, 1),
            "outputs": first,
        }
    finally:
        eng.close()
    problems = []
    if fingerprint.get(TP_KEY) != args.tensor_parallel_size:
        problems.append(f"fingerprint {TP_KEY}={fingerprint.get(TP_KEY)!r}")
    if len(set(pids)) != args.tensor_parallel_size:
        problems.append(f"{len(set(pids))} rank processes, not {args.tensor_parallel_size}")
    if any(len(o) != args.max_tokens for o in first):
        problems.append(f"outputs of {[len(o) for o in first]} tokens")
    if again != first:
        problems.append("a second greedy run gave other tokens")
    if args.compare and args.tensor_parallel_size > 1:
        ref = engine(args, 1)
        try:
            want = ref.generate(batch, greedy)
        finally:
            ref.close()
        same = sum(
            a == b
            for got, exp in zip(first, want, strict=True)
            for a, b in zip(got, exp, strict=True)
        )
        out["agreement_with_tp1"] = f"{same}/{len(batch) * args.max_tokens}"
    out["problems"] = problems
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.tp_check", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--compare", action="store_true", help="also run TP 1 and count agreement")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    tp = args.tensor_parallel_size
    line = (
        f"tp_check: TP {tp} on {out['device']} ({out['device_name']}, {out['dtype']}): "
        f"fingerprint {TP_KEY}={out['fingerprint'].get(TP_KEY)}, rank pids {out['rank_pids']}, "
        f"{args.prompts} prompts x {args.max_tokens} tokens in {out['cold_seconds']} s cold, "
        f"{out['warm_seconds']} s warm ({out['warm_tokens_per_second']} tok/s)"
    )
    if "agreement_with_tp1" in out:
        line += f", tokens agreeing with TP 1: {out['agreement_with_tp1']}"
    print(line + (f"; FAILED: {'; '.join(out['problems'])}" if out["problems"] else "; ok"))
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
