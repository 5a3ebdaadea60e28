"""Batch-1 decode with the AVX2 GEMV kernel and without it, in one engine (issue 42).

    taskset -c 0 .venv/bin/python -m perf.gemv_engine_bench [--weights int8|bf16] [--rounds 4]
        [--tokens 64] [--enforce-eager] [--json perf/results/gemv_engine_bench_int8.json]

SmolLM2-135M-Instruct, ``quantization int8`` (or ``dtype bfloat16``), the compiled decode step
(the engine's default; bf16 needs ``--enforce-eager``: its switch below is a module attribute
the compiled graph guards on), one thread, greedy, a 1-token prompt then ``--tokens`` decode steps timed around ``step()``
(as perf/llamacpp_bench.py times pdserve). The same engine serves both sides: the kernel is
switched off by making ``cpu_gemv.available()`` answer False, which sends every INT8 row count
to fbgemm (the served path before), inside the compiled graph too (the choice is made in the op
at run time); for bf16 by clearing the layers' ``_bf16_gemv`` (``F.linear``, as before). The sides alternate (ABBA) over ``--rounds``; tok/s is the median, by wall time and
by the forward's own time (``stats.seconds``). A shared machine: read the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import torch

from pdserve.kernels import cpu_gemv
from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from perf.llamacpp_bench import pdserve_sample

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--weights", choices=["int8", "bf16"], default="int8")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    json_path = args.json or RESULTS / f"gemv_engine_bench_{args.weights}.json"
    torch.set_num_threads(1)
    if not cpu_gemv.available():
        raise SystemExit("the AVX2 kernel is not available on this machine")
    eng = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype="float32" if args.weights == "int8" else "bfloat16",
            quantization="int8" if args.weights == "int8" else "none",
            enforce_eager=args.enforce_eager,
            block_size=16,
            num_kv_blocks=16,
            max_num_seqs=1,
            prefix_cache=False,
        )
    )
    real = cpu_gemv.available
    flagged = [m for m in eng.runner.model.modules() if getattr(m, "_bf16_gemv", False)]

    def use(on: bool) -> None:
        cpu_gemv.available = real if on else (lambda: False)
        for m in flagged:
            m._bf16_gemv = on

    before = "fbgemm" if args.weights == "int8" else "F.linear"
    sides = {"avx2 kernel": True, before: False}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    rng = random.Random(0)
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for label in order:
            use(sides[label])
            samples[label].append(pdserve_sample(eng, 1, 1, args.tokens, 2, rng, f"{label}{r}"))
            print(f"round {r} {label}: {samples[label][-1][0]:.1f} tok/s", flush=True)
    use(True)
    out = {
        "weights": args.weights,
        "enforce_eager": args.enforce_eager,
        "load": os.getloadavg(),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "sides": {},
    }
    for label, got in samples.items():
        wall = statistics.median(s[0] for s in got)
        fwd = statistics.median(s[1] for s in got)
        out["sides"][label] = {"tok_s": round(wall, 2), "forward_tok_s": round(fwd, 2)}
        print(f"{label:12s} {wall:6.1f} tok/s (forward {fwd:6.1f})")
    k, f = out["sides"]["avx2 kernel"], out["sides"][before]
    out["ratio"] = round(k["tok_s"] / f["tok_s"], 3)
    out["forward_ratio"] = round(k["forward_tok_s"] / f["forward_tok_s"], 3)
    print(
        f"kernel / {before}: {out['ratio']}x (forward {out['forward_ratio']}x); load {out['load']}"
    )
    json_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
