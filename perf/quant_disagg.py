"""Issue 18: a disaggregated 2,048-token prompt's time to first token for fp32 and INT8 weights,
each with the model-dtype and the int8 KV cache: one ``pdserve up`` stack per configuration (1
prefill + 1 decode worker, the default model), all running at once and taking the requests in
turn, so load on a shared machine hits them alike (idle stacks use ~0% CPU). Reports each
stack's median TTFT; the KV bytes per token each cache moves are ``perf/quant_bench.py``'s.

    python -m perf.quant_disagg [--prompt-tokens 2048] [--requests 5] [--configs none:auto,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from perf.stack_bench import start_stack, stop_stack

CONFIGS = "none:auto,none:int8,int8:auto,int8:int8"  # --quantization:--kv-cache-dtype


def ttft(base: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first text chunk."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {") and b'"text": ""' not in line:
                first = time.perf_counter() - start
                response.read()  # let the stream finish: the next request finds the stack idle
                return first
    raise RuntimeError("the stream ended without text")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--configs", default=CONFIGS, help="quantization:kv_cache_dtype,...")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    logs = Path(tempfile.mkdtemp(prefix="quant-disagg-"))
    stacks: dict[str, tuple] = {}
    times: dict[str, list[float]] = {c: [] for c in configs}
    try:
        for config in configs:
            quantization, kv = config.split(":")
            flags = ("--quantization", quantization, "--kv-cache-dtype", kv)
            log = logs / f"{config}.log"
            stacks[config] = start_stack("smollm2-135m-instruct", 1, log, flags)
        for i in range(args.requests):
            # a prompt of its own per round (no prefix-cache hit), the same for every stack
            prompt = [1000 + (i * 7919 + j * 31) % 40000 for j in range(args.prompt_tokens)]
            order = configs if i % 2 == 0 else configs[::-1]
            for config in order:
                times[config].append(ttft(stacks[config][1], prompt))
        result = {
            c: {"median_ttft_s": round(statistics.median(t), 3), "ttft_s": [round(x, 3) for x in t]}
            for c, t in times.items()
        }
    finally:
        for proc, _ in stacks.values():
            stop_stack(proc)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
