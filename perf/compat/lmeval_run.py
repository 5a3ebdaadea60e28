"""lm-eval's ``local-completions`` on the pdserve_mcq task against a running pdserve, checked
against HF transformers: the same choice picked for every question, and the log-likelihoods
close.

lm-eval tokenizes with the model's tokenizer.json itself and sends token ids to
``/v1/completions`` with ``echo: true``, ``logprobs: 1``, ``max_tokens: 1`` and ``temperature:
0`` (0.4.13 asks for one generated token and drops its log-prob); ``--batch_size N`` puts N
prompts in one request's ``prompt`` array.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from perf.compat.hf_mcq import OracleResult
from perf.compat.mcq import TASK_DIR, TASK_NAME, Scored, accuracy, load_questions
from perf.compat.stack import Stack
from perf.compat.tool import ToolResult, installed_version, pdserve_errors, run_logged, venv_bin

TIMEOUT_S = 900.0
# Agreement within float32 noise: pdserve (the converted GGUF, its own kernels and batching) and
# HF (transformers' GGUF reader) both compute in float32 from the same dequantized weights.
LL_TOLERANCE = 1e-2


def command(stack: Stack, tokenizer_dir: Path, batch_size: int, out: Path) -> list[str]:
    model_args = ",".join(
        [
            f"model={stack.model}",
            f"base_url={stack.base_url}/v1/completions",
            "tokenizer_backend=huggingface",  # not "auto": that probes the server for /tokenize
            f"tokenizer={tokenizer_dir}",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",  # a refused request fails the run at once, with pdserve's answer
        ]
    )
    return [
        str(venv_bin("lm-eval", "lm-eval")),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        TASK_NAME,
        "--include_path",
        str(TASK_DIR),
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(out),
        "--log_samples",
    ]


def read_samples(out: Path) -> list[Scored]:
    """Per question (in mcq.jsonl's order), the log-likelihood lm-eval got for each choice."""
    files = sorted(out.rglob(f"samples_{TASK_NAME}_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no samples_{TASK_NAME}_*.jsonl under {out}")
    by_doc: dict[int, Scored] = {}
    for line in files[-1].read_text().splitlines():
        sample = json.loads(line)
        lls = [float(resp[0]) for resp in sample["filtered_resps"]]
        doc = sample["doc"]
        by_doc[sample["doc_id"]] = Scored(lls, [len(c) for c in doc["choices"]], doc["answer"])
    return [by_doc[i] for i in sorted(by_doc)]


def compare(ours: list[Scored], oracle: OracleResult) -> dict:
    same = sum(s.pick == pick for s, pick in zip(ours, oracle.picks, strict=True))
    diffs = [
        abs(a - b)
        for s, hf in zip(ours, oracle.lls, strict=True)
        for a, b in zip(s.lls, hf, strict=True)
    ]
    acc, acc_norm = accuracy(ours)
    return {
        "acc": acc,
        "acc_norm": acc_norm,
        "hf_acc": oracle.acc,
        "hf_acc_norm": oracle.acc_norm,
        "same_picks": same,
        "questions": len(ours),
        "max_abs_ll_diff": max(diffs),
        "median_abs_ll_diff": statistics.median(diffs),
    }


def matches_oracle(details: dict) -> bool:
    """Every question picked as HF picks it, every log-likelihood within LL_TOLERANCE."""
    return (
        details["same_picks"] == details["questions"] and details["max_abs_ll_diff"] <= LL_TOLERANCE
    )


def run_lm_eval(
    stack: Stack,
    tokenizer_dir: Path,
    batch_size: int,
    oracle: OracleResult,
    out: Path,
    exact: bool = True,
) -> ToolResult:
    """exact: the server runs the oracle's weights and arithmetic, so it must match it; else (a
    quantized server) the comparison is reported, not required."""
    name = f"lm-eval --batch_size {batch_size}"
    version = installed_version("lm-eval", "lm_eval")
    run_dir = out / f"lm-eval-bs{batch_size}"
    log = out / f"lm-eval-bs{batch_size}.log"
    # data_files in the task YAML are relative to the working directory: run from the task dir
    rc, seconds = run_logged(
        command(stack, tokenizer_dir, batch_size, run_dir), log, TIMEOUT_S, cwd=TASK_DIR
    )
    text = log.read_text(errors="replace")
    if rc != 0:
        errors = pdserve_errors(text) or [_last_error_line(text)]
        return ToolResult(name, version, False, f"exit {rc}: {errors[0]}", errors, {}, seconds)
    ours = read_samples(run_dir)
    if len(ours) != len(load_questions()):
        raise RuntimeError(f"lm-eval scored {len(ours)} questions, not all of mcq.jsonl")
    details = compare(ours, oracle)
    ok = matches_oracle(details) or not exact
    summary = (
        f"acc {details['acc']:.4f} (HF transformers {details['hf_acc']:.4f}), acc_norm "
        f"{details['acc_norm']:.4f} (HF {details['hf_acc_norm']:.4f}), same choice on "
        f"{details['same_picks']}/{details['questions']}, max |ll - HF ll| "
        f"{details['max_abs_ll_diff']:.1e} (median {details['median_abs_ll_diff']:.1e})"
    )
    return ToolResult(name, version, ok, summary, [], details, seconds)


def _last_error_line(text: str) -> str:
    lines = [x for x in text.splitlines() if "Error" in x or "error" in x]
    return lines[-1].strip() if lines else "no error text in the log"
