"""Results on disk: <name>.json (config, metrics, summary), <name>.records.jsonl (one line per
request), <name>.md (a table per run) and PNG plots (latency CDFs, activity over time, and
throughput/goodput/SLO attainment against request rate for sweeps).

A result holds one or more runs; several runs are a sweep over request rates, and the
scenario harness puts several labelled series (e.g. "disaggregated", "aggregated") side by side.
The runs as data, their JSON and JSONL forms and reading them back are ``results``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.services.control.bench import bottleneck
from pdserve.services.control.bench.metrics import is_good, request_tpot
from pdserve.services.control.bench.results import (
    RunResult,
    load_runs,
    record_lines,
    result_document,
    write_json,
)

LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
TITLES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2el_ms": "E2E latency"}


def _fmt(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 1000 else f"{x:.0f}"


def markdown_table(runs: Sequence[RunResult]) -> str:
    """One row per run: load, throughput, goodput and the latency distributions (ms)."""
    # the percentiles the runs were computed with, except the median (it has its own column)
    percentiles = [p for p in runs[0].metrics.ttft_ms.percentiles if p != "p50"] if runs else []
    head = ["series", "rate (req/s)", "done/failed", "req/s", "out tok/s", "goodput (req/s)"]
    head.append("SLO attain.")
    for name in LATENCY_METRICS:
        head += [f"{TITLES[name]} {s}" for s in ("mean", "median", *percentiles)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        m = run.metrics
        has_slo = bool(m.goodput_slos_ms)
        row = [
            run.series,
            run.rate_label,
            f"{m.completed}/{m.failed}",
            _fmt(m.request_throughput),
            _fmt(m.output_throughput),
            _fmt(m.request_goodput) if has_slo else "-",
            f"{100 * m.slo_attainment:.1f}%" if has_slo else "-",
        ]
        for name in LATENCY_METRICS:
            d = getattr(m, name)
            row += [_fmt(d.mean), _fmt(d.median), *(_fmt(d.percentiles[p]) for p in percentiles)]
        lines.append("| " + " | ".join(row) + " |")
    slos = next((r.metrics.goodput_slos_ms for r in runs if r.metrics.goodput_slos_ms), None)
    if slos:
        lines.append("")
        lines.append("SLOs (ms): " + ", ".join(f"{k} <= {v:g}" for k, v in slos.items()))
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_samples(run: RunResult, name: str) -> np.ndarray:
    """The per-request (or, for ITL, pooled per-gap) values behind one distribution, in ms."""
    ok = [r for r in run.records if r.success]
    if name == "ttft_ms":
        values = [r.ttft for r in ok]
    elif name == "tpot_ms":
        values = [t for r in ok if (t := request_tpot(r)) is not None]
    elif name == "itl_ms":
        values = [g for r in ok for g in r.itl]
    elif name == "e2el_ms":
        values = [r.latency for r in ok]
    else:
        raise ValueError(name)
    return np.sort(np.asarray(values, dtype=np.float64) * 1000.0)


# one dash pattern per request rate (colour tells the series); sweeps rarely exceed six rates
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def plot_latency_cdfs(runs: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E: one colour per series, one dash per rate."""
    plt = _pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = list(dict.fromkeys(r.series for r in runs))
    rates = sorted({r.request_rate for r in runs})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name in zip(axes.flat, LATENCY_METRICS, strict=True):
        slo = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2el_ms": "e2el"}.get(name)
        lo, hi = math.inf, 0.0
        for run in runs:
            xs = latency_samples(run, name)
            if xs.size:
                ys = np.arange(1, xs.size + 1) / xs.size
                ax.step(
                    xs,
                    ys,
                    where="post",
                    color=colors[series.index(run.series) % len(colors)],
                    ls=LINESTYLES[rates.index(run.request_rate) % len(LINESTYLES)],
                    label=f"{run.series} @ {run.rate_label} req/s",
                )
                positive = xs[xs > 0]
                if positive.size:
                    lo, hi = min(lo, positive[0]), max(hi, positive[-1])
            limit = run.metrics.goodput_slos_ms.get(slo or "")
            # an SLO far right of every sample would squash the curves into one line
            if limit is not None and xs.size and limit <= 2 * xs[-1]:
                ax.axvline(limit, color="grey", ls="--", lw=0.8)
        if hi > 50 * lo:  # long-prompt TTFTs and queueing tails span decades
            ax.set_xscale("log")
        ax.set_xlabel(f"{TITLES[name]} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name == "itl_ms" else "requests"))
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    _save(plt, fig, path, title or "latency CDFs")


def _activity(run: RunResult, bin_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin start times, output tokens/s, requests in flight) over the run, from its records."""
    ok = [r for r in run.records if r.success]
    end = max((r.start_time + r.latency for r in ok), default=0.0)
    bins = np.arange(0.0, end + bin_s, bin_s)
    tokens = np.zeros(bins.size)
    inflight = np.zeros(bins.size)
    for r in ok:
        times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        # spread the server's token count over the chunks that carried it
        weight = r.output_tokens / times.size
        np.add.at(tokens, np.minimum((times / bin_s).astype(np.int64), bins.size - 1), weight)
        first = int(r.start_time / bin_s)
        last = int((r.start_time + r.latency) / bin_s)
        inflight[first : last + 1] += 1
    return bins, tokens / bin_s, inflight


def plot_timeline(runs: Sequence[RunResult], path: Path, title: str = "", bin_s: float = 1.0):
    """Output tokens/s and requests in flight over each run: queues building up show here."""
    plt = _pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = list(dict.fromkeys(r.series for r in runs))
    rates = sorted({r.request_rate for r in runs})
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for run in runs:
        t, tok, inflight = _activity(run, bin_s)
        style = {
            "color": colors[series.index(run.series) % len(colors)],
            "ls": LINESTYLES[rates.index(run.request_rate) % len(LINESTYLES)],
            "label": f"{run.series} @ {run.rate_label} req/s",
        }
        axes[0].step(t, tok, where="post", **style)
        axes[1].step(t, inflight, where="post", **style)
    axes[0].set_ylabel(f"output tokens/s ({bin_s:g} s bins)")
    axes[1].set_ylabel("requests in flight")
    axes[1].set_xlabel("time since the first request (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _save(plt, fig, path, title or "activity over time")


def attainment_at_scales(
    run: RunResult, slos_ms: dict[str, float], scales: Sequence[float]
) -> list[float]:
    """SLO attainment of a finished run had every SLO been `scale` times as loose: DistServe's
    second view of goodput, computed from the records without running anything again."""
    out = []
    for scale in scales:
        scaled = {k: v * scale for k, v in slos_ms.items()}
        good = sum(is_good(r, scaled) for r in run.records)
        out.append(good / len(run.records) if run.records else 0.0)
    return out


def plot_slo_scale(
    runs: Sequence[RunResult], slos_ms: dict[str, float], path: Path, title: str = ""
) -> None:
    """SLO attainment against SLO scale (1 = the SLOs used), one line per run."""
    plt = _pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = list(dict.fromkeys(r.series for r in runs))
    rates = sorted({r.request_rate for r in runs})
    scales = np.round(np.arange(0.25, 3.01, 0.125), 3)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ax.plot(
            scales,
            [100 * a for a in attainment_at_scales(run, slos_ms, scales)],
            color=colors[series.index(run.series) % len(colors)],
            ls=LINESTYLES[rates.index(run.request_rate) % len(LINESTYLES)],
            label=f"{run.series} @ {run.rate_label} req/s",
        )
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.axvline(1.0, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("SLO scale (x " + ", ".join(f"{k} {v:g} ms" for k, v in slos_ms.items()) + ")")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(plt, fig, path, title or "SLO attainment vs SLO scale")


def _rate_positions(runs: Sequence[RunResult]) -> tuple[dict[float, float], float | None]:
    """x position per offered rate; an unbounded rate goes one step right of the largest."""
    finite = sorted({r.request_rate for r in runs if math.isfinite(r.request_rate)})
    pos = {rate: rate for rate in finite}
    inf_x = None
    if any(math.isinf(r.request_rate) for r in runs):
        inf_x = finite[-1] * 1.25 if finite else 1.0
        pos[math.inf] = inf_x
    return pos, inf_x


def plot_sweep(runs: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Throughput, goodput and SLO attainment against offered request rate, one line per series."""
    plt = _pyplot()
    series: dict[str, list[RunResult]] = {}
    for run in runs:
        series.setdefault(run.series, []).append(run)
    pos, inf_x = _rate_positions(runs)
    has_slo = any(r.metrics.goodput_slos_ms for r in runs)
    fig, axes = plt.subplots(1, 3 if has_slo else 2, figsize=(15 if has_slo else 10, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, group) in enumerate(series.items()):
        c = colors[i % len(colors)]
        group = sorted(group, key=lambda r: r.request_rate)
        xs = [pos[r.request_rate] for r in group]
        axes[0].plot(xs, [r.metrics.output_throughput for r in group], "o-", c=c, label=name)
        axes[1].plot(xs, [r.metrics.request_throughput for r in group], "o-", c=c, label=name)
        if has_slo:
            goodput = [r.metrics.request_goodput for r in group]
            axes[1].plot(xs, goodput, "s--", c=c, label=f"{name} goodput")
            attainment = [100 * r.metrics.slo_attainment for r in group]
            axes[2].plot(xs, attainment, "o-", c=c, label=name)
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("requests / s")
    if has_slo:
        axes[2].set_ylabel("SLO attainment (%)")
        axes[2].axhline(90, color="grey", ls="--", lw=0.8)
        axes[2].set_ylim(0, 101)
    for ax in axes:
        ax.set_xlim(left=0)
        if inf_x is not None:  # label the unbounded point "inf" instead of a made-up number
            ticks = [t for t in ax.get_xticks() if 0 <= t < inf_x * 0.9] + [inf_x]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["inf"])
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path, title or "throughput and goodput vs request rate")


def write_outputs(
    runs: Sequence[RunResult],
    out_dir: Path,
    name: str,
    config: dict[str, Any],
    summary: dict[str, Any] | None = None,
    plots: bool = True,
    detailed: bool = True,
) -> dict[str, Path]:
    """Write <name>.json (+ .records.jsonl), <name>.md and the PNGs; return the paths by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json"}
    write_json(paths["json"], result_document(runs, config, summary))
    if detailed:
        paths["records"] = out_dir / f"{name}.records.jsonl"
        paths["records"].write_text("".join(line + "\n" for line in record_lines(runs)))
    return paths | write_report(runs, out_dir, name, summary, plots)


def write_report(
    runs: Sequence[RunResult],
    out_dir: Path,
    name: str,
    summary: dict[str, Any] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """<name>.md and the PNGs it shows."""
    paths = {"markdown": out_dir / f"{name}.md"}
    md = [f"# {name}", "", markdown_table(runs)]
    if summary:
        md += ["", *(f"- {k}: {v}" for k, v in summary.items()), ""]
    # which roof each phase hit (servers that export pdserve's roofline series)
    roofs = bottleneck.markdown(
        [(f"{r.series} @ {r.rate_label} req/s", r.metrics.bottleneck) for r in runs]
    )
    if roofs:
        md += ["", roofs]
    if plots and any(r.records for r in runs):
        paths["cdf"] = out_dir / f"{name}_latency_cdf.png"
        plot_latency_cdfs(runs, paths["cdf"], title=name)
        md.append(f"![latency CDFs]({paths['cdf'].name})")
        paths["timeline"] = out_dir / f"{name}_timeline.png"
        plot_timeline(runs, paths["timeline"], title=name)
        md.append(f"![tokens/s and requests in flight over time]({paths['timeline'].name})")
    slos = next((r.metrics.goodput_slos_ms for r in runs if r.metrics.goodput_slos_ms), None)
    if plots and slos and any(r.records for r in runs):
        paths["slo_scale"] = out_dir / f"{name}_slo_scale.png"
        plot_slo_scale(runs, slos, paths["slo_scale"], title=name)
        md.append(f"![SLO attainment vs SLO scale]({paths['slo_scale'].name})")
    if plots and len({r.request_rate for r in runs}) > 1:
        paths["sweep"] = out_dir / f"{name}_sweep.png"
        plot_sweep(runs, paths["sweep"], title=name)
        md.append(f"![throughput and goodput vs rate]({paths['sweep'].name})")
    paths["markdown"].write_text("\n".join(md) + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Re-render the markdown and plots of a saved result (its data files stay untouched)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m pdserve.services.control.bench.report", description=main.__doc__
    )
    p.add_argument("result", type=Path, help="a <name>.json written by pdserve bench")
    p.add_argument("--out", type=Path, default=None, help="folder (default: the result's)")
    args = p.parse_args(argv)
    runs, doc = load_runs(args.result)
    out = args.out or args.result.parent
    out.mkdir(parents=True, exist_ok=True)
    paths = write_report(runs, out, args.result.stem, doc["summary"])
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
