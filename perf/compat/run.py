"""Run the clients people use against a local ``pdserve up``, unmodified (issue 16):

    perf/compat/run.sh [guidellm|lm-eval|aiperf|langchain|anthropic|all] [--model NAME] [--out DIR] [--no-install]

Each tool lives in its own venv outside the repo (install.sh). One ``pdserve up`` on free ports
serves them one after another, then is stopped by its pid. lm-eval runs the local pdserve_mcq
task at each ``--batch-sizes`` and is checked against HF transformers scoring the same task on
the same weights (hf_mcq.py), computed before the stack starts; the same task is then scored by
requests with ``echo`` and ``max_tokens: 0`` sent directly (echo_check.py). A line per run is printed;
logs, reports and results.json stay in ``--out``. Exit status 0 when every run passed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from perf.compat import hf_mcq
from perf.compat.aiperf_run import run_aiperf
from perf.compat.anthropic_run import run_anthropic
from perf.compat.echo_check import run_echo_check
from perf.compat.guidellm_run import run_guidellm
from perf.compat.langchain_run import run_langchain
from perf.compat.lmeval_run import run_lm_eval
from perf.compat.stack import Stack, drain_leftovers, pdserve_up
from perf.compat.tool import COMPAT_DIR, ToolResult, install

TOOLS = ("guidellm", "lm-eval", "aiperf", "langchain", "anthropic")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="perf/compat/run.sh", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("tool", nargs="?", default="all", choices=[*TOOLS, "all"])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="pdserve up --model")
    parser.add_argument(
        "--out",
        type=Path,
        default=COMPAT_DIR / "runs" / time.strftime("%Y%m%d-%H%M%S"),
        help="logs and reports (default: a new folder under ~/.cache/pdserve-compat/runs)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="lm-eval's")
    parser.add_argument("--no-install", action="store_true", help="use the venvs as they are")
    parser.add_argument(
        "--up-args",
        default="",
        help="more pdserve up flags, e.g. '--quantization int8 --kv-cache-dtype int8'; with any, "
        "lm-eval's agreement with HF's fp32 is reported, not required",
    )
    return parser.parse_args(argv)


def report(result: ToolResult) -> None:
    verdict = "PASS" if result.ok else "FAIL"
    print(f"{verdict} {result.tool} {result.version} ({result.seconds:.0f} s): {result.summary}")
    for error in result.errors:
        print(f"     error: {error}")


def tool_runs(
    tool: str,
    stack: Stack,
    tokenizer_dir: Path,
    oracle: hf_mcq.OracleResult | None,
    args: argparse.Namespace,
) -> Iterator[ToolResult]:
    """Each run of ``tool``, one result at a time, so each is printed as soon as it ends."""
    if tool == "guidellm":
        yield run_guidellm(stack, tokenizer_dir, args.out)
    elif tool == "aiperf":
        yield run_aiperf(stack, tokenizer_dir, args.out)
    elif tool == "langchain":
        yield run_langchain(stack, args.out)
    elif tool == "anthropic":
        yield run_anthropic(stack, args.out)
    else:
        assert oracle is not None
        exact = not args.up_args
        for batch_size in args.batch_sizes:
            yield run_lm_eval(stack, tokenizer_dir, batch_size, oracle, args.out, exact)
        yield run_echo_check(stack, tokenizer_dir, oracle, exact)


def main(argv: list[str] | None = None) -> int:
    from pdserve.shared.models.resolve import resolve

    args = parse_args(argv)
    tools = TOOLS if args.tool == "all" else (args.tool,)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_install:
        for tool in tools:
            install(tool)
    tokenizer_dir = resolve(args.model).path  # the served model's own tokenizer.json
    oracle = None
    if "lm-eval" in tools:
        # before the stack starts: both would compete for the same 2 cores
        oracle = hf_mcq.run(args.model)
        (args.out / "hf_mcq.json").write_text(json.dumps(asdict(oracle), indent=1))
        print(
            f"HF transformers on pdserve_mcq: acc {oracle.acc:.4f}, acc_norm {oracle.acc_norm:.4f}"
        )
    results: list[ToolResult] = []
    up_args = tuple(shlex.split(args.up_args))
    with pdserve_up(args.out / "pdserve-up.log", args.model, up_args) as stack:
        print(f"pdserve up: {stack.model} at {stack.base_url} (pid {stack.proc.pid})")
        for tool in tools:
            for result in tool_runs(tool, stack, tokenizer_dir, oracle, args):
                results.append(result)
                report(result)
    leftovers = drain_leftovers(stack.log)
    for line in leftovers:
        print(f"WARN pdserve, stopped after the clients were done: {line}")
    (args.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"logs and reports: {args.out}")
    return 0 if all(r.ok for r in results) and not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
