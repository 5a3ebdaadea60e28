"""Side-by-side verdicts: a candidate against a baseline per request rate and overall
(DistServe goodput), engine step times against the latency seen through HTTP, each checked
against a scenario's targets. Renders comparison.md and the numbers behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.services.control.bench.metrics import max_goodput_rate
from pdserve.services.control.bench.results import RunResult
from perf.bench.topology import EngineSteps


@dataclass
class Targets:
    """What the candidate must achieve against the baseline (ratios candidate / baseline)."""

    max_p99_tpot_ratio: float | None = None
    min_goodput_ratio: float | None = None
    max_token_overhead_ms: float | None = None  # TPOT p50 through HTTP minus engine step time


class ScenarioLike(Protocol):
    name: str
    description: str
    baseline: str | None
    candidate: str | None
    targets: Targets


def scenario_report(
    results: list[RunResult],
    scenario: ScenarioLike,
    target_attainment: float,
    workload: str = "",
    engine_steps: dict[str, EngineSteps] | None = None,
) -> tuple[str, dict[str, Any]]:
    """comparison.md and its numbers: candidate/baseline ratios per rate and overall, engine
    step times against the latency seen through HTTP, each checked against the targets."""
    base_name, cand_name = scenario.baseline, scenario.candidate
    series = {r.series for r in results}
    paired = base_name in series and cand_name in series
    title = f"# {scenario.name}" + (f": {cand_name} vs {base_name}" if paired else "")
    lines = [title, "", scenario.description, ""]
    if workload:
        lines += [f"Workload: {workload}.", ""]
    summary: dict[str, Any] = {}
    verdicts: list[str] = []
    t = scenario.targets
    if paired:
        lines += _comparison_section(results, scenario, target_attainment, summary, verdicts)
    if engine_steps:
        lines += _engine_section(results, engine_steps, t, summary, verdicts)
    if verdicts:
        lines += ["", *(f"- {v}" for v in verdicts)]
    return "\n".join(lines) + "\n", summary


def _verdict(value: float | None, target: float, at_most: bool) -> tuple[bool, str]:
    """Whether `value` meets the target, and the words for it: "met", or by how much not."""
    if value is None:
        return False, "MISSED (not measured)"
    ok = value <= target if at_most else value >= target
    if ok:
        return True, "met"
    return False, f"MISSED by {abs(value - target) / target:.0%}"


def _comparison_section(
    results: list[RunResult],
    scenario: ScenarioLike,
    target_attainment: float,
    summary: dict[str, Any],
    verdicts: list[str],
) -> list[str]:
    base_name, cand_name = scenario.baseline, scenario.candidate
    by = {(r.series, r.request_rate): r for r in results}
    lines = [
        "| rate (req/s) | p99 TTFT base | p99 TTFT cand | ratio | p99 TPOT base | p99 TPOT cand "
        "| ratio | goodput base | goodput cand | ratio | attain. base | attain. cand |",
        "|" + "---|" * 12,
    ]
    rows = []
    for rate in sorted({r.request_rate for r in results}):
        b, c = by.get((base_name, rate)), by.get((cand_name, rate))
        if b is None or c is None:
            continue
        bm, cm = b.metrics, c.metrics
        row = {
            "rate": rate,
            "ttft_p99_ratio": _ratio(cm.ttft_ms.p(99), bm.ttft_ms.p(99)),
            "tpot_p99_ratio": _ratio(cm.tpot_ms.p(99), bm.tpot_ms.p(99)),
            "goodput_ratio": _ratio(cm.request_goodput, bm.request_goodput),
            "base_attainment": bm.slo_attainment,
        }
        rows.append(row)
        lines.append(
            f"| {b.rate_label} | {bm.ttft_ms.p(99):.1f} | {cm.ttft_ms.p(99):.1f} | "
            f"{_fmt_ratio(row['ttft_p99_ratio'])} | {bm.tpot_ms.p(99):.2f} | "
            f"{cm.tpot_ms.p(99):.2f} | {_fmt_ratio(row['tpot_p99_ratio'])} | "
            f"{bm.request_goodput:.3f} | {cm.request_goodput:.3f} | "
            f"{_fmt_ratio(row['goodput_ratio'])} | {100 * bm.slo_attainment:.0f}% | "
            f"{100 * cm.slo_attainment:.0f}% |"
        )

    def max_rate(name: str | None) -> float | None:
        pts = [(r.request_rate, r.metrics.slo_attainment) for r in results if r.series == name]
        return max_goodput_rate(pts, target_attainment)

    gb, gc = max_rate(base_name), max_rate(cand_name)
    ratio = _ratio(gc, gb)
    summary.update(
        baseline=base_name,
        candidate=cand_name,
        per_rate=rows,
        distserve_goodput_base=gb,
        distserve_goodput_cand=gc,
        distserve_goodput_ratio=ratio,
    )
    lines += [
        "",
        f"DistServe goodput (highest rate with >= {target_attainment:.0%} SLO attainment, "
        f"tested rates only): {base_name} {gb}, {cand_name} {gc}, ratio {_fmt_ratio(ratio)}",
    ]
    for name, value in ((base_name, gb), (cand_name, gc)):
        if value is None:
            lines.append(
                f"- {name} met the SLOs for {target_attainment:.0%} of requests at no tested "
                "rate: sweep lower rates (--rate-factors) or relax the SLOs to find its goodput."
            )
    t = scenario.targets
    if rows and t.max_p99_tpot_ratio is not None:
        row = tpot_judging_row(rows)
        r = row["tpot_p99_ratio"]
        ok, words = _verdict(r, t.max_p99_tpot_ratio, at_most=True)
        verdicts.append(
            f"p99 TPOT ratio at {row['rate']:g} req/s {_fmt_ratio(r)} "
            f"(target <= {t.max_p99_tpot_ratio}x): {words}"
        )
        summary["tpot_target_met"] = ok
        summary["tpot_judged_at_rate"] = row["rate"]
    if t.min_goodput_ratio is not None:
        ok, words = _verdict(ratio, t.min_goodput_ratio, at_most=False)
        verdicts.append(
            f"goodput ratio {_fmt_ratio(ratio)} (target >= {t.min_goodput_ratio}x): {words}"
        )
        summary["goodput_target_met"] = ok
    return lines


def tpot_judging_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rate where the TPOT target is judged: the highest one at which the baseline still
    met its SLOs for at least half the requests. Higher up both sides only queue, and p99 TPOT
    compares two backlogs rather than prefill-decode interference. Rows ascend by rate."""
    loaded = [row for row in rows if row["base_attainment"] >= 0.5]
    return loaded[-1] if loaded else rows[0]


def _engine_section(
    results: list[RunResult],
    engine_steps: dict[str, EngineSteps],
    t: Targets,
    summary: dict[str, Any],
    verdicts: list[str],
) -> list[str]:
    """What the HTTP path adds per token: TPOT seen by the client minus the engine's step."""
    lines = [
        "",
        "| run | p50 TPOT (HTTP) | p50 ITL (HTTP) | engine decode step mean | overhead per token "
        "| decode steps | prompts prefilled remotely |",
        "|" + "---|" * 7,
    ]
    rows = {}
    for r in results:
        key = f"{r.series} @ {r.rate_label}"
        steps = engine_steps.get(key)
        if steps is None or not steps.steps:
            continue
        # TPOT minus the step time is a per-token cost only when each step decodes this one
        # request; with a batch, a step serves many requests and the difference means nothing
        overhead = r.metrics.tpot_ms.median - steps.mean_ms if r.max_concurrency == 1 else None
        rows[key] = {
            "tpot_p50_ms": r.metrics.tpot_ms.median,
            "itl_p50_ms": r.metrics.itl_ms.median,
            "engine_step_mean_ms": steps.mean_ms,
            "overhead_ms": overhead,
            "decode_steps": steps.steps,
            "remote_prefills": steps.remote_prefills,
        }
        lines.append(
            f"| {key} | {r.metrics.tpot_ms.median:.3f} | {r.metrics.itl_ms.median:.3f} | "
            f"{steps.mean_ms:.3f} | {'n/a' if overhead is None else f'{overhead:.3f}'} | "
            f"{steps.steps} | {steps.remote_prefills} |"
        )
        if steps.warning:
            verdicts.append(f"WARNING: {steps.warning}; this run does not measure what it says")
    lines += [
        "",
        "Overhead = p50 TPOT through the API minus the mean decode step the workers timed "
        "(their Prometheus histogram), shown for runs with one request at a time; "
        "ITL is per SSE chunk, and a chunk may carry several tokens while the detokenizer waits "
        "for a whole UTF-8 character.",
    ]
    summary["engine"] = rows
    overheads = [row["overhead_ms"] for row in rows.values() if row["overhead_ms"] is not None]
    if t.max_token_overhead_ms is not None and overheads:
        worst = max(overheads)
        ok, words = _verdict(worst, t.max_token_overhead_ms, at_most=True)
        verdicts.append(
            f"per-token overhead {worst:.3f} ms at p50 (target <= {t.max_token_overhead_ms} ms): "
            f"{words}"
        )
        summary["overhead_target_met"] = ok
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"
