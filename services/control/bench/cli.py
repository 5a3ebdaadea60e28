"""`pdserve bench`: load an OpenAI-compatible endpoint and report vLLM-comparable metrics.

    pdserve bench --base-url http://127.0.0.1:8000 --dataset chat --num-requests 200 \
        --request-rate 1 2 4 8 --goodput ttft:500 tpot:50 --result-name chat-sweep

sends token-id prompts to /v1/completions (streaming, `ignore_eos`, usage in the last chunk),
prints a summary per rate, and writes perf/results/chat-sweep.{json,md} plus latency-CDF and
throughput/goodput-vs-rate PNGs. Any server that takes token-id prompts works (vLLM, SGLang,
pdserve). `--tokenizer MODEL_DIR` draws prompt ids from the model's vocabulary; without it ids
come from --token-id-range (printable ASCII bytes, ordinary tokens in every common vocabulary).

This module is the command: its options and `run`. The work of a run (datasets, warm-up, one
measured run per rate, the printed summary) is ``sweep``; the files written, ``report``. Only
argparse is imported at module level: the CLI imports this module to build its parser, and
`pdserve --help` must not pay for numpy, aiohttp or matplotlib.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

DATASETS = ("random", "chat", "shared-prefix")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("request rate must be > 0 (or inf)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _unit(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _range_ratio(text: str) -> float:
    value = _unit(text)
    if value == 1.0:  # a ratio of 1 would allow zero-length prompts
        raise argparse.ArgumentTypeError("must be below 1")
    return value


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        pair = (0, -1)
    if not sep or not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO <= HI, got {text!r}")
    return pair


def _percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or not all(0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError("percentiles must be in [0, 100]")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server base URL")
    target.add_argument("--endpoint", default="/v1/completions", help="completions path")
    target.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    target.add_argument(
        "--api-key",
        # a local pdserve reads its accepted keys from PDSERVE_API_KEY (comma separated)
        default=os.environ.get("OPENAI_API_KEY")
        or (os.environ.get("PDSERVE_API_KEY") or "").split(",")[0].strip()
        or None,
        help="Bearer key [env OPENAI_API_KEY, else the first of PDSERVE_API_KEY]",
    )
    target.add_argument("--timeout", type=float, default=600.0, help="per-request limit, seconds")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop at EOS (output lengths are then not exact)",
    )
    target.add_argument(
        "--warmup-requests",
        type=_non_negative,
        default=1,
        help="unmeasured requests (own prompts, same distribution) sent one by one first",
    )

    data = p.add_argument_group("dataset (prompts are token ids, so lengths are exact)")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--num-requests", type=_positive, default=200)
    data.add_argument(
        "--input-len",
        type=_positive,
        default=512,
        help="prompt length (random: mean; chat: median; shared-prefix: suffix length)",
    )
    data.add_argument(
        "--output-len", type=_positive, default=128, help="output length (chat: median)"
    )
    data.add_argument(
        "--range-ratio",
        type=_range_ratio,
        default=0.0,
        help="random/shared-prefix: lengths uniform in len*(1-r)..len*(1+r)",
    )
    data.add_argument("--input-sigma", type=float, default=1.0, help="chat: log-normal sigma")
    data.add_argument("--output-sigma", type=float, default=0.7, help="chat: log-normal sigma")
    data.add_argument("--max-input-len", type=_positive, default=4096, help="chat: longest prompt")
    data.add_argument("--max-output-len", type=_positive, default=1024, help="chat: longest output")
    data.add_argument(
        "--prefix-len", type=_positive, default=1024, help="shared-prefix: system prompt"
    )
    data.add_argument(
        "--num-prefixes", type=_positive, default=4, help="shared-prefix: distinct ones"
    )
    data.add_argument(
        "--long-fraction",
        type=_unit,
        default=0.0,
        help="fraction of requests whose prompt is replaced by a long one (mixed workload)",
    )
    data.add_argument(
        "--long-input-range", type=_range, default=(2048, 4096), help="long prompt lengths LO:HI"
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="model dir or tokenizer.json: draw ids from its vocabulary minus special tokens",
    )
    data.add_argument(
        "--token-id-range",
        type=_range,
        default=(32, 126),
        help="ids LO:HI (inclusive) used without --tokenizer; the default is plain ASCII bytes, "
        "ordinary tokens in byte-level and BPE vocabularies alike",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        help="requests/s; several values run a sweep; inf sends all at once",
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 bursty"
    )
    load.add_argument(
        "--max-concurrency", type=_positive, default=None, help="most requests in flight"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of dataset and arrivals")

    out = p.add_argument_group("metrics and output")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)",
    )
    out.add_argument(
        "--slo-attainment-target",
        type=_unit,
        default=0.9,
        help="sweep goodput = highest rate with at least this SLO attainment (DistServe)",
    )
    out.add_argument(
        "--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], help="e.g. 50,90,99"
    )
    out.add_argument("--result-dir", default="perf/results", help="where results are written")
    out.add_argument("--result-name", default=None, help="file name stem (default: bench-...)")
    out.add_argument("--label", default="pdserve", help="series name in tables and plots")
    out.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    out.add_argument(
        "--no-detailed", dest="detailed", action="store_false", help="omit per-request records"
    )
    out.add_argument("--no-progress", dest="progress", action="store_false")


def make_parser() -> argparse.ArgumentParser:
    """A standalone parser with the same options (used by the scenario harness and tests)."""
    p = argparse.ArgumentParser(prog="pdserve bench")
    add_arguments(p)
    return p


def describe(ns: argparse.Namespace) -> dict[str, Any]:
    """The options that define the workload, stored with every result."""
    skip = {"api_key", "command", "progress", "plots", "detailed"}
    return {k: v for k, v in sorted(vars(ns).items()) if k not in skip and not k.startswith("_")}


def run(ns: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    import aiohttp

    from pdserve.services.control.bench.report import write_outputs
    from pdserve.services.control.bench.sweep import bench_sweep, sweep_summary

    try:
        results = asyncio.run(bench_sweep(ns))
    except (RuntimeError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        # an unreachable or misconfigured endpoint: one clear line, not a traceback
        print(f"pdserve bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    name = ns.result_name or f"bench-{ns.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    summary = sweep_summary(results, ns.slo_attainment_target)
    paths = write_outputs(
        results, Path(ns.result_dir), name, describe(ns), summary, ns.plots, ns.detailed
    )
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0 if all(r.metrics.completed > 0 for r in results) else 1
