"""Issue 18: the real default model in fp32, bf16 and int8 weights, each with an fp32 (model
dtype) and a quantized KV cache, in one run: batch-1 decode tok/s and TTFT, batch-32 throughput
and KV bytes per token. Quality against fp32 is perf/quant_quality.py.

    .venv/bin/python -m perf.quant_bench [--configs none:float32:auto,int8:float32:auto ...]
        [--rounds 3]

Every configuration's engine is loaded first; then each round measures them one after another,
and each figure is the median over rounds, so a noisy stretch of a shared machine hits them alike.

The KV bytes per token below are what a disaggregated pull moves; the pull itself is timed by
perf/kv_bench.py and the disaggregated TTFT of a 2k-token prompt by perf/quant_disagg.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams

DEFAULT_CONFIGS = (
    "none:float32:auto,none:float32:int8,none:bfloat16:auto,none:bfloat16:int8,"
    "int8:float32:auto,int8:float32:int8"
)


def build(quantization: str, dtype: str, kv: str) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(dtype=dtype, quantization=quantization, kv_cache_dtype=kv, num_kv_blocks=512)
    )
    engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    return engine


PROMPT = list(range(1000, 1064))


def measure(engine: LLMEngine, decode_tokens: int, batch: int) -> dict[str, float]:
    """One round: TTFT of the 64-token prompt, batch-1 decode rate, batch throughput."""
    greedy = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([PROMPT], greedy)
    b1 = decode_tokens / (time.perf_counter() - t0 - ttft)
    prompts = [[1000 + i] + PROMPT[1:16] for i in range(batch)]
    t0 = time.perf_counter()
    engine.generate(prompts, greedy)
    bn = batch * decode_tokens / (time.perf_counter() - t0)
    return {
        "ttft_64_tokens_ms": ttft * 1e3,
        "batch1_decode_tok_s": b1,
        f"batch{batch}_tok_s": bn,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="quantization:dtype:kv,...")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="configs alternate within each round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = [tuple(item.split(":")) for item in args.configs.split(",")]
    engines = {c: build(*c) for c in configs}  # all loaded first, then measured side by side
    samples: dict[tuple, list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            samples[c].append(measure(engines[c], args.decode_tokens, args.batch))
    base = configs[0]
    base_b1 = statistics.median(s["batch1_decode_tok_s"] for s in samples[base])
    for c in configs:
        row = {k: round(statistics.median(s[k] for s in samples[c]), 1) for k in samples[c][0]}
        print(
            json.dumps(
                {
                    "quantization": c[0],
                    "dtype": c[1],
                    "kv_cache_dtype": c[2],
                    **row,
                    f"batch1_vs_{':'.join(base)}": round(row["batch1_decode_tok_s"] / base_b1, 2),
                    "kv_bytes_per_token": engines[c].bytes_per_block // engines[c].block_size,
                }
            )
        )


if __name__ == "__main__":
    main()
