"""Quality of a quantized engine against its fp32 self (issue 18): perplexity of a fixed text and
greedy agreement over prompts, both through the engine's own scheduler, paged cache and kernels.

The text (perf/data/quality_text.txt) was written for this repository and is free to use. Its
perplexity is taken from the engine's prompt log-probs, the prompt fed in chunks of
``max_num_batched_tokens`` so later chunks read earlier ones back from the (quantized) KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from shared.sampling import SamplingParams

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


def text_tokens(tokenizer, max_tokens: int | None = None) -> list[int]:
    ids = tokenizer.encode(QUALITY_TEXT.read_text())
    return ids[:max_tokens] if max_tokens else ids


def prompt_tokens(tokenizer, count: int = len(PROMPTS)) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS[:count]]


def perplexity(engine, token_ids: list[int]) -> float:
    """exp of the mean negative log-prob of token_ids[1:] given the tokens before each."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    engine.add_request("ppl", token_ids, sampling)
    logprobs: list[float] = []
    while engine.has_unfinished():
        result = engine.step()
        for out in result.outputs if result else ():
            if out.prompt_logprobs is not None:
                logprobs.extend(out.prompt_logprobs.token_logprobs)
    if len(logprobs) != len(token_ids) - 1:
        raise RuntimeError(f"got {len(logprobs)} prompt log-probs for {len(token_ids)} tokens")
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, sampling)


def measure(engine, text_ids: list[int], prompts: list[list[int]], max_tokens: int):
    return QualityResult(perplexity(engine, text_ids), greedy(engine, prompts, max_tokens))


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
