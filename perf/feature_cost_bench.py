"""What log-probs and structured output cost per generated token, in the engine, side by side.

One engine, one workload of ``--batch`` requests decoding ``--tokens`` tokens each (EOS
ignored, greedy), run in rounds that alternate the variants (each round starting with the next one), so
machine noise hits each variant alike; the figure is each variant's median time per output token over the rounds, and its ratio
to the plain run:

- ``plain``: no log-probs, no grammar;
- ``logprobs``: the sampled token's log-prob and 5 alternatives (``logprobs=5``);
- ``prompt_logprobs``: echo's prompt log-probs (``prompt_logprobs=5``), per prompt token;
- ``json_object``: structured output, any JSON object (``ignore_eos`` off: a grammar ends it,
  so the measured tokens are those generated);
- ``json_schema``: a small schema with bounded fields;
- ``tool_call``: ``tool_choice: "required"`` of one tool (the ``SCHEMA`` as its parameters,
  ``parallel_tool_calls: false``), the hermes-format grammar the gateway builds for it
  (``gateway/tools/grammar.py``): a tool-constrained request against plain decoding.

    python -m perf.feature_cost_bench [--model smollm2-135m-instruct] [--batch 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve.gateway.tools.grammar import tool_guide
from pdserve.gateway.tools.setup import ToolSetup
from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import GuidedDecoding, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "year", "tags"],
}
TOOL = ToolSetup(
    functions=({"name": "describe_book", "parameters": SCHEMA},),
    choice="required",
    parser="hermes",
    parallel=False,
)
PROMPT = (
    "Describe a famous book as JSON with its name, the year it appeared and a few tags. "
    "Answer with JSON only.\n"
)


def variants(tokens: int) -> dict[str, SamplingParams]:
    base = dict(temperature=0.0, max_tokens=tokens)
    return {
        "plain": SamplingParams(**base, ignore_eos=True),
        "logprobs": SamplingParams(**base, ignore_eos=True, logprobs=5),
        "prompt_logprobs": SamplingParams(**base, ignore_eos=True, prompt_logprobs=5),
        "json_object": SamplingParams(**base, guided=GuidedDecoding("json_object")),
        "tool_call": SamplingParams(**base, guided=tool_guide(TOOL)),
        "json_schema": SamplingParams(
            **base, guided=GuidedDecoding("json_schema", json.dumps(SCHEMA))
        ),
    }


def run(engine: LLMEngine, prompt: list[int], sp: SamplingParams, batch: int) -> tuple[float, int]:
    start = time.perf_counter()
    outs = engine.generate([prompt] * batch, sp)
    return time.perf_counter() - start, sum(len(o) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", num_kv_blocks=512))
    from pdserve.gateway.tokenizer import ModelTokenizer

    prompt = ModelTokenizer.from_dir(engine.model_dir).encode(PROMPT)
    todo = variants(args.tokens)
    for sp in todo.values():  # warm-up: first calls, grammar compilation
        run(engine, prompt, sp, 1)
    per_token: dict[str, list[float]] = {name: [] for name in todo}
    tokens: dict[str, int] = {}
    names = list(todo)
    for r in range(args.rounds):
        # each round starts with another variant, so no variant always follows the same one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sp = todo[name]
            seconds, n = run(engine, prompt, sp, args.batch)
            per_token[name].append(seconds / n)
            tokens[name] = n
    plain = statistics.median(per_token["plain"])
    results = {}
    print(f"batch {args.batch}, {args.rounds} alternating rounds, {args.model}")
    print(f"{'variant':>16} {'tokens':>7} {'ms/token':>9} {'vs plain':>9} {'extra ms':>9}")
    for name, values in per_token.items():
        med = statistics.median(values)
        results[name] = {
            "output_tokens": tokens[name],
            "ms_per_token": round(med * 1e3, 3),
            "ratio_to_plain": round(med / plain, 3),
            "extra_ms_per_token": round((med - plain) * 1e3, 3),
        }
        r = results[name]
        print(
            f"{name:>16} {tokens[name]:>7} {r['ms_per_token']:>9} {r['ratio_to_plain']:>9} "
            f"{r['extra_ms_per_token']:>9}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "rounds": args.rounds, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
