"""The CPU half of perf/kernels_bench.py: the plain-torch twin of decode attention, timed.

On CPU the twin *is* the engine's attention, so its per-layer cost is what a decode step pays
30 times on the served model. `python -m perf.kernels_bench` runs this where there is no CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from perf.kernels_bench import DecodeCase, Result, decode_inputs, format_result

# The CPU twin on the served SmolLM2-135M's attention (GQA 9/3, head dim 64) in fp32: a decode
# batch of 48 and batch 1, one query per sequence and 1 + 4 (speculative verification).
TWIN_CASES = [
    DecodeCase(batch=48, context=512, num_q_heads=9, num_kv_heads=3, head_dim=64),
    DecodeCase(batch=48, context=512, num_q_heads=9, num_kv_heads=3, head_dim=64, q_len=5),
    DecodeCase(batch=1, context=2048, num_q_heads=9, num_kv_heads=3, head_dim=64),
    DecodeCase(batch=1, context=2048, num_q_heads=9, num_kv_heads=3, head_dim=64, q_len=5),
]
MAX_ABS_ERR_FP32 = 1e-4


def cpu_time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest wall time of one call on CPU, after two warm-ups. The fastest, not the median:
    on a shared VM other processes only ever add time, and medians there swing several-fold."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def bench_twin_decode(case: DecodeCase, repeats: int) -> list[Result]:
    """The CPU twin per layer call with the step's plan made once (what the engine pays per
    layer), the plan itself (once per step), and SDPA on dense K/V (no page gather)."""
    from pdserve.kernels import reference

    inputs = decode_inputs(case, torch.device("cpu"), torch.float32)
    q, k_cache, *_ = args = inputs.args()
    cu, width = inputs.cu_seqlens_q, case.q_len
    group = case.num_q_heads // case.num_kv_heads
    plan = reference.DecodePlan(inputs.table, inputs.context_lens, cu, width)  # once per step
    expected = inputs.sdpa()

    def layer() -> torch.Tensor:
        if cu is None:  # the plain call exactly as the engine makes it today
            return reference.decode_attention(*args, plan)
        return reference.decode_attention(*args, plan, cu, width)

    def make_plan() -> object:
        return reference.DecodePlan(inputs.table, inputs.context_lens, cu, width).groups(
            k_cache, group
        )

    results = []
    for impl, fn in (("twin", layer), ("twin_plan", make_plan), ("sdpa_dense", inputs.sdpa)):
        ms = cpu_time_ms(fn, repeats)
        err = None
        if impl == "twin":
            err = (layer() - expected).abs().max().item()
        gbps = inputs.moved_bytes / (ms * 1e-3) / 1e9 if impl != "twin_plan" else None
        results.append(
            Result("decode_attention", case.name, impl, ms, gbps=gbps, max_abs_err_vs_sdpa=err)
        )
    return results


def twin_main(args: argparse.Namespace) -> int:
    results: list[Result] = []
    for case in TWIN_CASES:
        for r in bench_twin_decode(case, args.repeats):
            print(format_result(r), flush=True)
            results.append(r)
    wrong = [r for r in results if (r.max_abs_err_vs_sdpa or 0.0) > MAX_ABS_ERR_FP32]
    for r in wrong:
        print(f"WRONG RESULT (err > {MAX_ABS_ERR_FP32}): {format_result(r)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": "cpu",
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "all_results_correct": not wrong,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return 1 if wrong else 0
