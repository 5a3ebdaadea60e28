"""Issue 18: the real default model in fp32, bf16 and int8 weights, each with an fp32 (model
dtype) and a quantized KV cache, in one run: batch-1 decode tok/s and TTFT, batch-32 throughput
and KV bytes per token. Quality against fp32 is perf/quant_quality.py.

    .venv/bin/python -m perf.quant_bench [--configs none:float32:auto,int8:float32:auto ...]

Not yet measured here: disaggregated TTFT of a 2k-token prompt over UCX (the bytes per token
below are what such a pull moves).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from services.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams

DEFAULT_CONFIGS = (
    "none:float32:auto,none:float32:int8,none:bfloat16:auto,none:bfloat16:int8,"
    "int8:float32:auto,int8:float32:int8"
)


def measure(quantization: str, dtype: str, kv: str, decode_tokens: int, batch: int) -> dict:
    engine = LLMEngine(
        EngineConfig(dtype=dtype, quantization=quantization, kv_cache_dtype=kv, num_kv_blocks=512)
    )
    prompt = list(range(1000, 1064))
    greedy = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([prompt], greedy)
    b1 = decode_tokens / (time.perf_counter() - t0 - ttft)
    prompts = [[1000 + i] + prompt[1:16] for i in range(batch)]
    t0 = time.perf_counter()
    engine.generate(prompts, greedy)
    bn = batch * decode_tokens / (time.perf_counter() - t0)
    return {
        "quantization": quantization,
        "dtype": dtype,
        "kv_cache_dtype": kv,
        "ttft_64_tokens_ms": round(ttft * 1e3, 1),
        "batch1_decode_tok_s": round(b1, 1),
        f"batch{batch}_tok_s": round(bn, 1),
        "kv_bytes_per_token": engine.bytes_per_block // engine.block_size,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="quantization:dtype:kv,...")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for item in args.configs.split(","):
        quantization, dtype, kv = item.split(":")
        print(json.dumps(measure(quantization, dtype, kv, args.decode_tokens, args.batch)))


if __name__ == "__main__":
    main()
