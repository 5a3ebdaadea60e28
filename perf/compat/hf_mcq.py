"""The pdserve_mcq task scored directly with HF transformers on the same weights: the oracle that
lm-eval's run against pdserve must agree with (same choice picked for every question).

The weights are the GGUF of the built-in model, loaded by transformers' own GGUF reader (not
pdserve's conversion); the tokens are those of the model's tokenizer.json, split into context and
continuation exactly as lm-eval's API models split them (mcq.encode_pair), so both sides score
the same token sequences.

    .venv/bin/python -m perf.compat.hf_mcq [--model smollm2-135m-instruct] [--out hf.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from perf.compat.mcq import Question, Scored, accuracy, encode_pair, load_questions


@dataclass
class OracleResult:
    acc: float
    acc_norm: float
    picks: list[int]  # per question, as in mcq.jsonl
    lls: list[list[float]]  # per question, per choice: sum of the continuation's log-probs
    seconds: float


def load_model(spec: str):
    """(model, encode) for a pdserve --model value: the GGUF through transformers' reader when
    the model is a GGUF, the directory as it is otherwise; tokens from its tokenizer.json."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from pdserve.shared.models.resolve import resolve

    resolved = resolve(spec)
    # transformers' GGUF reader draws progress bars on stderr that would bury the results
    with contextlib.redirect_stderr(io.StringIO()):
        if resolved.source.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(
                str(resolved.source.parent), gguf_file=resolved.source.name, dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return model.eval(), encode


def score_question(model, encode, q: Question) -> Scored:
    """One forward pass per choice; the continuation's log-probs summed."""
    import torch

    lls = []
    for continuation in q.continuations:
        context_ids, continuation_ids = encode_pair(encode, q.context, continuation)
        ids = torch.tensor([context_ids + continuation_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(context_ids) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        picked = logprobs.gather(1, torch.tensor(continuation_ids)[:, None])
        lls.append(float(picked.sum()))
    return Scored(lls, [len(c) for c in q.choices], q.answer)


def run(spec: str = "smollm2-135m-instruct") -> OracleResult:
    import torch

    torch.set_num_threads(1)  # 2 shared cores: leave one to everybody else
    start = time.monotonic()
    model, encode = load_model(spec)
    scored = [score_question(model, encode, q) for q in load_questions()]
    acc, acc_norm = accuracy(scored)
    return OracleResult(
        acc, acc_norm, [s.pick for s in scored], [s.lls for s in scored], time.monotonic() - start
    )


def main(argv: list[str] | None = None) -> OracleResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.model)
    print(f"HF transformers, pdserve_mcq: acc {result.acc:.4f}, acc_norm {result.acc_norm:.4f}")
    if args.out:
        args.out.write_text(json.dumps(asdict(result), indent=1))
    return result


if __name__ == "__main__":
    main()
