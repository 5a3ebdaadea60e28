"""The roofline plot of a perf/roofline_bench.py result: arithmetic intensity (FLOP/byte, log)
against achieved FLOP/s (log), the memory roof (peak bytes/s x intensity) up to the ridge and the
compute roof after it, one labelled point per case.

    python -m perf.roofline_plot perf/results/roofline_bench.json perf/results/roofline_cpu.png
    python -m perf.roofline_plot AFTER.json OUT.png BEFORE.json   # before and after, one machine

With a second report (an earlier tree's run on the same machine), its cases are drawn hollow,
each with an arrow to the same case of the first report: what changed between the two trees.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import numpy as np

STYLE = {  # (phase, weights) -> marker, colour
    ("decode", "none"): ("o", "tab:blue"),
    ("decode", "int8"): ("s", "tab:orange"),
    ("prefill", "none"): ("^", "tab:green"),
    ("prefill", "int8"): ("v", "tab:red"),
}


def measured(report: dict) -> list[dict]:
    return [c for c in report["cases"] if "intensity" in c["result"]]


def plot(report: dict, path: Path, before: dict | None = None) -> None:
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    cases = measured(report)
    earlier = measured(before) if before is not None else []
    roof = report["peaks"]["roof"]
    peak_f, peak_b = roof["flops_per_s"], roof["bytes_per_s"]
    xs = [c["result"]["intensity"] for c in cases + earlier]
    lo = min([*xs, roof["ridge"]]) / 4
    hi = max([*xs, roof["ridge"]]) * 4
    grid = np.logspace(np.log10(lo), np.log10(hi), 400)
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(
        grid,
        np.minimum(peak_b * grid, peak_f),
        color="black",
        lw=1.8,
        label=f"roof: {peak_b / 1e9:,.1f} GB/s x intensity, {peak_f / 1e9:,.0f} GFLOP/s",
    )
    for when, ls in (("before", ":"), ("after", "--")):
        p = report["peaks"][when]
        ax.plot(
            grid,
            np.minimum(p["bytes_per_s"] * grid, p["flops_per_s"]),
            color="grey",
            lw=0.9,
            ls=ls,
            label=f"peaks measured {when} the workload",
        )
    ax.axvline(roof["ridge"], color="grey", lw=0.6)
    ax.text(roof["ridge"], peak_f * 1.15, f"ridge {roof['ridge']:.1f}", ha="center", fontsize=8)
    seen: set[tuple[str, str]] = set()
    # labels: float weights' to the right of their points, INT8's to the left (the two series
    # share intensities); prefill points, close together, alternately above and below
    dy = (3, -19)
    order = {
        id(c): i
        for key in STYLE
        for i, c in enumerate(
            sorted(
                (c for c in cases if (c["phase"], c["weights"]) == key),
                key=lambda c: c["result"]["intensity"],
            )
        )
    }
    for c in cases:
        r, key = c["result"], (c["phase"], c["weights"])
        marker, colour = STYLE.get(key, ("x", "tab:purple"))
        label = None
        if key not in seen:
            seen.add(key)
            label = f"{c['phase']}, {'INT8' if c['weights'] == 'int8' else 'float'} weights"
        ax.scatter(
            r["intensity"],
            r["flops_per_s"],
            marker=marker,
            color=colour,
            s=45,
            zorder=3,
            label=label,
        )
        pct = r["bandwidth_fraction"] if r["bound"] == "memory" else r["compute_fraction"]
        left = c["weights"] == "int8"
        crowded = c["phase"] == "prefill"  # on a near-flat line: alternate above and below
        ax.annotate(
            f"{c['name']}\n{pct:.0%} of {'BW' if r['bound'] == 'memory' else 'peak'}",
            (r["intensity"], r["flops_per_s"]),
            textcoords="offset points",
            xytext=(-6 if left else 6, dy[order.get(id(c), 0) % 2] if crowded else -8),
            ha="right" if left else "left",
            fontsize=7,
            color=colour,
        )
    after = {c["name"]: c["result"] for c in cases}
    for c in earlier:  # the earlier tree: hollow, an arrow to where the case is now
        r, key = c["result"], (c["phase"], c["weights"])
        marker, colour = STYLE.get(key, ("x", "tab:purple"))
        ax.scatter(
            r["intensity"],
            r["flops_per_s"],
            marker=marker,
            facecolors="none",
            edgecolors=colour,
            s=45,
            zorder=2,
            label="before" if c is earlier[0] else None,
        )
        now = after.get(c["name"])
        if now is not None:
            ax.annotate(
                "",
                xy=(now["intensity"], now["flops_per_s"]),
                xytext=(r["intensity"], r["flops_per_s"]),
                arrowprops={"arrowstyle": "->", "color": colour, "lw": 0.7, "alpha": 0.6},
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ys = [c["result"]["flops_per_s"] for c in cases + earlier]
    ax.set_ylim(min([*ys, peak_b * lo]) / 2, peak_f * 2)
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("achieved FLOP/s (over the forward passes' wall time)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    m = report["machine"]
    ax.set_title(f"{report['model']} on {m['device']} ({roof['dtype']})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    earlier = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else None
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), earlier)
