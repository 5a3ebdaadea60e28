"""`pdserve bench`: load an OpenAI-compatible endpoint and report vLLM-comparable metrics.

    pdserve bench --base-url http://127.0.0.1:8000 --dataset chat --num-requests 200 \
        --request-rate 1 2 4 8 --goodput ttft:500 tpot:50 --result-name chat-sweep

sends token-id prompts to /v1/completions (streaming, `ignore_eos`, usage in the last chunk),
prints a summary per rate, and writes perf/results/chat-sweep.{json,md} plus latency-CDF and
throughput/goodput-vs-rate PNGs. Any server that takes token-id prompts works (vLLM, SGLang,
pdserve). `--tokenizer MODEL_DIR` draws prompt ids from the model's vocabulary; without it ids
come from --token-id-range (printable ASCII bytes, ordinary tokens in every common vocabulary).

Only argparse is imported at module level: the CLI imports this module to build its parser,
and `pdserve --help` must not pay for numpy, aiohttp or matplotlib.
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


# Seed offsets: each rate of a sweep and the warm-up get prompts of their own, so a server's
# prefix cache can never answer a later run from an earlier one. Every side of a comparison
# still gets the very same prompts for the same rate.
WARMUP_SEED_OFFSET = 1_000_003
CLIENT_BUSY = 0.7  # client CPU per wall second above which its numbers are suspect
CALIBRATION_SEED_OFFSET = 2_000_003
# pdserve's gateway learns its workers' speculation totals from their heartbeats (0.5 s apart
# by default): wait that long after a run before reading them
SPEC_SETTLE_S = 1.0


def build_dataset(
    ns: argparse.Namespace, seed_offset: int = 0, num_requests: int | None = None
) -> list[Any]:
    import numpy as np

    from pdserve.shared.bench import datasets as ds

    rng = np.random.default_rng(ns.seed + seed_offset)
    if ns.tokenizer:
        tokens = ds.token_space_from_tokenizer(ns.tokenizer)
    else:
        lo, hi = ns.token_id_range
        tokens = ds.TokenSpace(lo, hi + 1)
    n = ns.num_requests if num_requests is None else num_requests
    if ns.dataset == "random":
        reqs = ds.random_dataset(n, ns.input_len, ns.output_len, ns.range_ratio, tokens, rng)
    elif ns.dataset == "chat":
        reqs = ds.chat_dataset(
            n,
            ns.input_len,
            ns.output_len,
            tokens,
            rng,
            ns.input_sigma,
            ns.output_sigma,
            ns.max_input_len,
            ns.max_output_len,
        )
    else:
        reqs = ds.shared_prefix_dataset(
            n,
            ns.num_prefixes,
            ns.prefix_len,
            ns.input_len,
            ns.output_len,
            ns.range_ratio,
            tokens,
            rng,
        )
    if ns.long_fraction > 0:
        reqs = ds.with_long_prompts(reqs, ns.long_fraction, ns.long_input_range, tokens, rng)
    return reqs


def describe(ns: argparse.Namespace) -> dict[str, Any]:
    """The options that define the workload, stored with every result."""
    skip = {"api_key", "command", "progress", "plots", "detailed"}
    return {k: v for k, v in sorted(vars(ns).items()) if k not in skip and not k.startswith("_")}


def client_config(ns: argparse.Namespace, base_url: str, model: str) -> Any:
    from pdserve.shared.bench.client import ClientConfig

    return ClientConfig(
        base_url=base_url,
        model=model,
        endpoint=ns.endpoint,
        api_key=ns.api_key,
        temperature=ns.temperature,
        ignore_eos=ns.ignore_eos,
        timeout=ns.timeout,
    )


async def measure_rate(
    ns: argparse.Namespace,
    cfg: Any,
    requests: list[Any],
    rate: float,
    slos: dict[str, float],
    series: str,
    seed_offset: int = 0,
    max_concurrency: int | None = None,
) -> Any:
    """One measured run of `requests` at `rate`; returns a RunResult with its metrics."""
    import asyncio

    from pdserve.shared.bench.client import LoadConfig, run_benchmark
    from pdserve.shared.bench.metrics import compute_metrics
    from pdserve.shared.bench.report import RunResult
    from pdserve.shared.bench.spec_counters import scrape_spec

    conc = max_concurrency if max_concurrency is not None else ns.max_concurrency
    load = LoadConfig(rate, ns.burstiness, conc, ns.seed + seed_offset)
    spec_before = await asyncio.to_thread(scrape_spec, cfg.base_url, cfg.api_key)
    run = await run_benchmark(requests, cfg, load, ns.progress, desc=f"{series} @ {rate:g}/s")
    metrics = compute_metrics(run.records, run.duration, slos, ns.percentiles)
    metrics.client_cpu_fraction = run.client_cpu_s / run.duration
    if spec_before is not None:  # the server speculates: what did this run draft and accept?
        await asyncio.sleep(SPEC_SETTLE_S)
        spec_after = await asyncio.to_thread(scrape_spec, cfg.base_url, cfg.api_key)
        if spec_after is not None:
            spec = spec_after.since(spec_before)
            metrics.spec_drafts = int(spec.drafts)
            metrics.spec_draft_tokens = int(spec.draft_tokens)
            metrics.spec_accepted_tokens = int(spec.accepted_tokens)
    return RunResult(series, rate, ns.burstiness, conc, metrics, run.records)


async def bench_sweep(ns: argparse.Namespace) -> list[Any]:
    """Warm up, then run the workload once per request rate against ns.base_url."""
    from pdserve.shared.bench.client import discover_model, warm_up
    from pdserve.shared.bench.metrics import parse_goodput

    if ns.endpoint.rstrip("/").endswith("chat/completions"):
        # exact prompt lengths need token ids, which only the completions API accepts
        raise RuntimeError("use a completions endpoint (/v1/completions): prompts are token ids")
    slos = parse_goodput(ns.goodput)
    model = ns.model or await discover_model(ns.base_url, ns.api_key)
    cfg = client_config(ns, ns.base_url, model)
    if ns.warmup_requests > 0:
        await warm_up(cfg, build_dataset(ns, WARMUP_SEED_OFFSET, ns.warmup_requests))
    results = []
    for i, rate in enumerate(ns.request_rate):
        requests = build_dataset(ns, seed_offset=i)
        result = await measure_rate(ns, cfg, requests, rate, slos, ns.label, seed_offset=i)
        print_summary(result)
        results.append(result)
    return results


def print_summary(result: Any) -> None:
    m = result.metrics
    lines = [
        f"== {result.series} @ {result.rate_label} req/s ==",
        f"requests ok/failed: {m.completed}/{m.failed} in {m.duration_s:.2f} s",
        f"throughput: {m.request_throughput:.2f} req/s, {m.output_throughput:.1f} out tok/s, "
        f"{m.total_token_throughput:.1f} total tok/s",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = getattr(m, name)
        pct = ", ".join(f"{k} {v:.2f}" for k, v in d.percentiles.items())
        lines.append(f"{name[:-3].upper():5s} ms: mean {d.mean:.2f}, median {d.median:.2f}, {pct}")
    if m.goodput_slos_ms:
        lines.append(
            f"goodput: {m.request_goodput:.2f} req/s, SLO attainment {100 * m.slo_attainment:.1f}%"
        )
    if m.spec_acceptance_rate is not None and m.spec_mean_acceptance_length is not None:
        lines.append(
            f"speculative decoding: acceptance {100 * m.spec_acceptance_rate:.1f}% "
            f"({m.spec_accepted_tokens}/{m.spec_draft_tokens} draft tokens), "
            f"mean acceptance length {m.spec_mean_acceptance_length:.2f} over {m.spec_drafts} drafts"
        )
    if m.client_cpu_fraction > CLIENT_BUSY:
        lines.append(
            f"warning: the bench client used {m.client_cpu_fraction:.0%} of a core; it may be "
            "the bottleneck (run it on its own cores, or lower the load)"
        )
    if m.output_len_mismatches:
        lines.append(f"warning: {m.output_len_mismatches} requests returned != max_tokens tokens")
    if m.failed:
        first = next(r for r in result.records if not r.success)
        lines.append(f"first failure: {first.error}")
    print("\n".join(lines), flush=True)


def sweep_summary(results: list[Any], target: float) -> dict[str, Any]:
    from pdserve.shared.bench.metrics import max_goodput_rate

    summary: dict[str, Any] = {}
    for series in dict.fromkeys(r.series for r in results):
        group = [r for r in results if r.series == series]
        if group and group[0].metrics.goodput_slos_ms and len(group) > 1:
            points = [(r.request_rate, r.metrics.slo_attainment) for r in group]
            summary[f"{series}: max rate with >= {target:.0%} SLO attainment"] = max_goodput_rate(
                points, target
            )
    return summary


def run(ns: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    import aiohttp

    from pdserve.shared.bench.report import write_outputs

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
