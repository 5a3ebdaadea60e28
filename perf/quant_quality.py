"""Quality of a quantized engine against its fp32 self (issue 18): perplexity of a fixed text and
greedy agreement over prompts, both through the engine's own scheduler, paged cache and kernels.

The text (perf/data/quality_text.txt) was written for this repository and is free to use. Its
perplexity is taken from the engine's prompt log-probs, the prompt fed in chunks of
``max_num_batched_tokens`` so later chunks read earlier ones back from the (quantized) KV cache.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.shared.sampling import SamplingParams, TokenLogprobs

QUALITY_TEXT = Path(__file__).parent / "data" / "quality_text.txt"

# 20 prompts written here: greedy continuations are compared token by token
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a bicycle stays upright while moving.",
    "List three uses of copper.",
    "Once upon a time, in a village at the edge of a forest,",
    "What is the difference between weather and climate?",
    "def fibonacci(n):",
    "The three primary colours are",
    "Give me a recipe for a simple tomato soup.",
    "Why do leaves change colour in autumn?",
    "Translate 'good morning' into Spanish.",
    "The most important thing about learning a new language is",
    "Describe the water cycle in two sentences.",
    "A train leaves the station at nine o'clock and travels at sixty kilometres an hour.",
    "What are the benefits of regular exercise?",
    "In the year 1969, astronauts",
    "Summarise the plot of a detective story in one paragraph.",
    "How does a refrigerator keep food cold?",
    "The best way to start the day is",
    "Name the planets of the solar system in order.",
]


@dataclass
class QualityResult:
    perplexity: float
    greedy: list[list[int]]


def prompt_logprobs(engine, prompts: dict[str, list[int]]) -> dict[str, TokenLogprobs]:
    """Each prompt's log-probs (and ranks) of its tokens after the first, given those before."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for rid, token_ids in prompts.items():
        engine.add_request(rid, token_ids, sampling)
    got = {rid: TokenLogprobs() for rid in prompts}
    while engine.has_unfinished():
        result = engine.step()
        for out in result.outputs if result else ():
            if out.prompt_logprobs is not None:
                got[out.bus_id].extend(out.prompt_logprobs)
    for rid, token_ids in prompts.items():
        if len(got[rid]) != len(token_ids) - 1:
            raise RuntimeError(
                f"{rid}: {len(got[rid])} prompt log-probs for {len(token_ids)} tokens"
            )
    return got


def perplexity(engine, token_ids: list[int]) -> float:
    """exp of the mean negative log-prob of token_ids[1:] given the tokens before each."""
    logprobs = prompt_logprobs(engine, {"ppl": token_ids})["ppl"].token_logprobs
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, sampling)


def measure(engine, text_ids: list[int], prompts: list[list[int]], max_tokens: int):
    return QualityResult(perplexity(engine, text_ids), greedy(engine, prompts, max_tokens))


def teacher_forced(engine, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Share of reference (fp32 greedy) tokens that are this engine's argmax given the prompt and
    the reference tokens before them: agreement without a free-running path's divergence, so one
    near-tie flip costs one position, not the rest of the continuation."""
    requests = {f"tf{i}": p + r for i, (p, r) in enumerate(zip(prompts, reference, strict=True))}
    ranks = {rid: lp.ranks for rid, lp in prompt_logprobs(engine, requests).items()}
    hits = total = 0
    for i, (p, r) in enumerate(zip(prompts, reference, strict=True)):
        tail = ranks[f"tf{i}"][len(p) - 1 :]  # entry j scores token j+1: the reference's tokens
        hits += sum(rank == 1 for rank in tail)
        total += len(r)
    return hits / total


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """positional: share of positions whose token matches; prefix: share of tokens before the
    first mismatch (stricter: every token after a divergence counts as lost)."""
    total = sum(len(r) for r in reference)
    same = sum(
        a == b for r, o in zip(reference, other, strict=True) for a, b in zip(r, o, strict=False)
    )
    prefix = 0
    for r, o in zip(reference, other, strict=True):
        n = 0
        while n < min(len(r), len(o)) and r[n] == o[n]:
            n += 1
        prefix += n
    return {"positional": same / total, "prefix": prefix / total}


def engine_for(setting: str, default_alpha: float | None):
    """``quantization:dtype[:kv[:pattern+pattern...[:alpha]]]``; the patterns are the linear
    layers kept float (``int8_linear.FLOAT_LINEARS`` for this engine), alpha SmoothQuant's
    (empty: ``default_alpha``, the module's as shipped; ``none``: no smoothing)."""
    from pdserve.services.engine.engine import LLMEngine
    from pdserve.services.engine.quant import int8_linear
    from pdserve.shared.config import EngineConfig

    parts = setting.split(":")
    quantization, dtype, kv, keep, alpha = parts + ["auto", "", ""][len(parts) - 2 :]
    int8_linear.FLOAT_LINEARS = tuple(p for p in keep.split("+") if p)
    alphas = {"": default_alpha, "none": None}
    int8_linear.SMOOTH_ALPHA = alphas[alpha] if alpha in alphas else float(alpha)
    config = EngineConfig(
        dtype=dtype, quantization=quantization, kv_cache_dtype=kv, num_kv_blocks=256
    )
    return LLMEngine(config)


def main() -> None:
    import torch
    from tokenizers import Tokenizer

    from pdserve.services.engine.quant import int8_linear

    default_alpha = int8_linear.SMOOTH_ALPHA
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--settings",
        default="none:bfloat16,int8:float32",
        help="comma-separated quantization:dtype[:kv[:float-pattern+...[:alpha|none]]], "
        "each against fp32",
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--batch1", action="store_true", help="also fp32 one prompt at a time")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = engine_for("none:float32", None)
    tok = Tokenizer.from_file(str(base.model_dir / "tokenizer.json"))
    text = tok.encode(QUALITY_TEXT.read_text()).ids
    prompts = [tok.encode(p).ids for p in PROMPTS[: args.prompts]]
    ref = measure(base, text, prompts, args.tokens)
    self_tf = teacher_forced(base, prompts, ref.greedy)  # prefill vs decode numerics alone
    print(
        json.dumps(
            {
                "setting": "none:float32",
                "perplexity": round(ref.perplexity, 4),
                "teacher_forced": round(self_tf, 4),
            }
        )
    )
    if args.batch1:
        one = [greedy(base, [p], args.tokens)[0] for p in prompts]
        print(json.dumps({"setting": "none:float32 batch 1", **agreement(ref.greedy, one)}))
    del base
    for setting in args.settings.split(","):
        t0 = time.perf_counter()
        engine = engine_for(setting, default_alpha)
        start_s = time.perf_counter() - t0
        got = measure(engine, text, prompts, args.tokens)
        row = {
            "setting": setting,
            "perplexity": round(got.perplexity, 4),
            "ppl_vs_fp32_pct": round(100 * (got.perplexity / ref.perplexity - 1), 2),
            **{k: round(v, 4) for k, v in agreement(ref.greedy, got.greedy).items()},
            "teacher_forced": round(teacher_forced(engine, prompts, ref.greedy), 4),
            "start_s": round(start_s, 2),
        }
        print(json.dumps(row), flush=True)
        del engine


if __name__ == "__main__":
    main()
