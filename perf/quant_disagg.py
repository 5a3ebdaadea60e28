"""Issue 18: a disaggregated 2,048-token prompt's time to first token with the model-dtype KV
cache against the int8 one, the two ``pdserve up`` stacks (1 prefill + 1 decode worker, the
default model) running at once and taking the requests in turn, so load on a shared machine
hits both alike (idle stacks use ~0% CPU). Reports each stack's median TTFT; the KV bytes per
token each cache moves are ``perf/quant_bench.py``'s.

    python -m perf.quant_disagg [--prompt-tokens 2048] [--requests 5]
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

KV_DTYPES = ("auto", "int8")


def ttft(base: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first text chunk."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
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
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="quant-disagg-"))
    stacks = {
        kv: start_stack("smollm2-135m-instruct", 1, logs / f"{kv}.log", ("--kv-cache-dtype", kv))
        for kv in KV_DTYPES
    }
    times: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    try:
        for i in range(args.requests):
            # a prompt of its own per round (no prefix-cache hit), the same for both stacks
            prompt = [1000 + (i * 7919 + j * 31) % 40000 for j in range(args.prompt_tokens)]
            order = KV_DTYPES if i % 2 == 0 else KV_DTYPES[::-1]
            for kv in order:
                times[kv].append(ttft(stacks[kv][1], prompt))
        result = {
            kv: {"median_ttft_s": round(statistics.median(t), 3),
                 "ttft_s": [round(x, 3) for x in t]}
            for kv, t in times.items()
        }  # fmt: skip
    finally:
        for proc, _ in stacks.values():
            stop_stack(proc)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
