"""One `pdserve bench` invocation's work: the workload its options describe, a warm-up, one
measured run per request rate (with the server's speculation and roofline counters around it:
``spec_counters``, ``bottleneck``), and the summary printed after each. The scenario harness (perf/scenarios.py) drives the same pieces per topology.

The options themselves are ``cli``, which imports this module only when a benchmark runs.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np

from pdserve.services.control.bench import bottleneck as bn
from pdserve.services.control.bench import datasets as ds
from pdserve.services.control.bench.client import (
    ClientConfig,
    LoadConfig,
    discover_model,
    run_benchmark,
    warm_up,
)
from pdserve.services.control.bench.metrics import compute_metrics, max_goodput_rate, parse_goodput
from pdserve.services.control.bench.results import RunResult
from pdserve.services.control.bench.spec_counters import SpecTotals, parse_spec, scrape_metrics

# Seed offsets: each rate of a sweep and the warm-up get prompts of their own, so a server's
# prefix cache can never answer a later run from an earlier one. Every side of a comparison
# still gets the very same prompts for the same rate.
WARMUP_SEED_OFFSET = 1_000_003
CLIENT_BUSY = 0.7  # client CPU per wall second above which its numbers are suspect
CALIBRATION_SEED_OFFSET = 2_000_003
# pdserve's gateway learns its workers' speculation and roofline totals from their heartbeats
# (0.5 s apart by default): wait that long after a run before reading them
SPEC_SETTLE_S = 1.0


def build_dataset(
    ns: argparse.Namespace, seed_offset: int = 0, num_requests: int | None = None
) -> list[ds.BenchRequest]:
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


def client_config(ns: argparse.Namespace, base_url: str, model: str) -> ClientConfig:
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
    cfg: ClientConfig,
    requests: list[ds.BenchRequest],
    rate: float,
    slos: dict[str, float],
    series: str,
    seed_offset: int = 0,
    max_concurrency: int | None = None,
) -> RunResult:
    """One measured run of `requests` at `rate`; returns a RunResult with its metrics."""
    conc = max_concurrency if max_concurrency is not None else ns.max_concurrency
    load = LoadConfig(
        request_rate=rate,
        burstiness=ns.burstiness,
        max_concurrency=conc,
        seed=ns.seed + seed_offset,
    )
    spec_before, roof_before = await server_counters(cfg)
    if roof_before is not None:
        # the warm-up's (or the previous run's) last passes reach the gateway with the next
        # heartbeat: read again once it came, so they are not counted as this run's
        await asyncio.sleep(SPEC_SETTLE_S)
        spec_before, roof_before = await server_counters(cfg)
    run = await run_benchmark(requests, cfg, load, ns.progress, desc=f"{series} @ {rate:g}/s")
    metrics = compute_metrics(run.records, run.duration, slos, ns.percentiles)
    metrics.client_cpu_fraction = run.client_cpu_s / run.duration
    if spec_before is not None or roof_before is not None:
        await asyncio.sleep(SPEC_SETTLE_S)
        spec_after, roof_after = await server_counters(cfg)
        if spec_before is not None and spec_after is not None:
            # the server speculates: what did this run draft and accept?
            spec = spec_after.since(spec_before)
            metrics.spec_drafts = int(spec.drafts)
            metrics.spec_draft_tokens = int(spec.draft_tokens)
            metrics.spec_accepted_tokens = int(spec.accepted_tokens)
        if roof_before is not None and roof_after is not None:
            # which roof each phase's forward passes hit during the run
            metrics.bottleneck = bn.as_dicts(bn.bottleneck(roof_before, roof_after))
    return RunResult(
        series=series,
        request_rate=rate,
        burstiness=ns.burstiness,
        max_concurrency=conc,
        metrics=metrics,
        records=run.records,
    )


async def server_counters(cfg: ClientConfig) -> tuple[SpecTotals | None, bn.Snapshot | None]:
    """The server's speculation and roofline counters from one read of its /metrics (None for
    what it does not expose, or both when the page cannot be read)."""
    page = await asyncio.to_thread(scrape_metrics, cfg.base_url, cfg.api_key)
    if page is None:
        return None, None
    try:
        return parse_spec(page), bn.parse_roofline(page)
    except ValueError:  # not a Prometheus page
        return None, None


async def bench_sweep(ns: argparse.Namespace) -> list[RunResult]:
    """Warm up, then run the workload once per request rate against ns.base_url."""
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


def print_summary(result: RunResult) -> None:
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
    lines += bn.summary_lines(m.bottleneck)
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


def sweep_summary(results: list[RunResult], target: float) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for series in dict.fromkeys(r.series for r in results):
        group = [r for r in results if r.series == series]
        if group and group[0].metrics.goodput_slos_ms and len(group) > 1:
            points = [(r.request_rate, r.metrics.slo_attainment) for r in group]
            summary[f"{series}: max rate with >= {target:.0%} SLO attainment"] = max_goodput_rate(
                points, target
            )
    return summary
