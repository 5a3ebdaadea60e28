"""What a decode step costs by its row count: the price adaptive K pays for each draft (issue 42).

    taskset -c 1 .venv/bin/python -m perf.step_rows_bench [--rows 1 2 3 4 5 6 7 8 12 16 24]
        [--context 300] [--reps 15] [--threads 1] [--json perf/results/issue42/step_rows.json]

Workload: SmolLM2-135M-Instruct in float32, the engine's default CPU path (the compiled decode
step, and the C++ decoder where it serves the row count), one torch thread. A step is one
sequence's speculative verification: R query tokens at positions ``context`` .. ``context`` + R - 1
over one block table (R = 1: a plain decode row), run through ``DecodeGraphs.run`` and the LM
head (``compute_logits``), as the engine's step runs them; the cache holds whatever is in it (the
timing does not depend on the values). Each row count runs 3 unmeasured steps, then ``--reps``
timed ones; the table gives the medians and each count's cost against one row.

The same script runs an older tree side by side (``PYTHONPATH`` pointing ``pdserve`` at its
worktree), so before and after come from one machine in one sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepInputs
from pdserve.shared.config import EngineConfig


def verification(rows: int, context: int, block_size: int, vocab: int) -> StepInputs:
    """One sequence's step of ``rows`` query tokens after ``context`` cached ones."""
    blocks = list(range(1, (context + rows) // block_size + 2))
    return StepInputs(
        input_ids=[(500 + i) % vocab for i in range(rows)],
        counts=[rows],
        starts=[context],
        block_tables=[blocks],
        num_decodes=1 if rows == 1 else 0,
        num_verifies=0 if rows == 1 else 1,
        read=list(range(rows)),
        num_sampled=rows,
        lora_slots=[],
    )


def measure(engine: LLMEngine, rows: int, context: int, reps: int) -> dict[str, float]:
    """Median ms of the layers (``DecodeGraphs.run``) and of the LM head over ``reps`` steps."""
    graphs, model = engine.runner.graphs, engine.runner.model
    if graphs is None:
        raise SystemExit("no compiled decode step: this bench measures the engine's default path")
    step = verification(rows, context, engine.config.block_size, engine.model_config.vocab_size)
    layers, head = [], []
    with torch.inference_mode():
        for i in range(3 + reps):
            t0 = time.perf_counter()
            hidden = graphs.run(step)
            t1 = time.perf_counter()
            model.compute_logits(hidden)
            t2 = time.perf_counter()
            if i >= 3:
                layers.append(t1 - t0)
                head.append(t2 - t1)
    return {
        "rows": rows,
        "layers_ms": 1e3 * statistics.median(layers),
        "lm_head_ms": 1e3 * statistics.median(head),
        "fused": graphs.fused is not None and graphs._runs_fused(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="", help="a name for this tree in the JSON")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32"))
    results = [measure(engine, r, args.context, args.reps) for r in args.rows]
    one = results[0]["layers_ms"] + results[0]["lm_head_ms"]
    print(f"{args.model}, float32, {args.threads} thread(s), context {args.context}")
    print("rows  layers ms  LM head ms  step ms  vs first  C++ decoder")
    for r in results:
        total = r["layers_ms"] + r["lm_head_ms"]
        r["step_ms"], r["vs_first"] = total, total / one
        print(
            f"{r['rows']:4d}  {r['layers_ms']:9.2f}  {r['lm_head_ms']:10.2f}  {total:7.2f}"
            f"  {total / one:7.2f}x  {'yes' if r['fused'] else 'no'}"
        )
    if args.json:
        out = {
            "label": args.label,
            "model": args.model,
            "threads": args.threads,
            "context": args.context,
            "rows": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
