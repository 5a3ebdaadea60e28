"""The simulated half of perf/planner_bench.py: the same low -> high -> low ramp on the planner's
simulated engine (services/control/planner/simulate.py) at a GPU host's scale, where the budget leaves the
planner room to move. Three fleets go through one seeded arrival sequence:

- ``autoscale``: the SLA planner (``Planner.step``) every window, within the budget;
- ``fixed 1P1D``: the fleet ``pdserve up`` starts by default;
- ``fixed best``: the P:D the offline advisor (``pdserve plan``'s ``advise``) picks for the
  ramp's *peak* rate within the same budget, held all the way through (what one would deploy
  without a planner, sized for the worst hour).

Also the shared row and plot helpers the CPU half uses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.services.control.planner.advisor import advise
from pdserve.services.control.planner.decide import Planner
from pdserve.services.control.planner.inputs import Limits, PlannerConfig
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import RateSchedule, SimConfig, SimResult
from pdserve.services.control.planner.simulate import simulate
from pdserve.services.control.planner.workload import SLO, Workload

# the ramp's phases (RateSchedule.ramp's shape), for attainment by phase
PHASES = (("low", 0.0, 0.1), ("rise", 0.1, 0.4), ("peak", 0.4, 0.6), ("fall", 0.6, 0.9),
          ("low again", 0.9, 1.0))  # fmt: skip


@dataclass(frozen=True)
class SimSetup:
    """The GPU-host ramp. ISL 512-1536 and OSL 128-384 (uniform, mean 1024 / 256) are a chat-like
    mix; the SLO is an interactive one for an 8B model on an H200."""

    gpus: int = 8
    low: float = 8.0  # requests/s
    high: float = 80.0
    duration_s: float = 900.0
    window_s: float = 30.0
    startup_s: float = 60.0  # a GPU worker's model load, from "start" to its first request
    ttft_ms: float = 500.0
    itl_ms: float = 20.0
    percentile: str = "p90"
    seed: int = 0

    def workload(self) -> Workload:
        rng = random.Random(self.seed)
        pairs = [(rng.randint(512, 1536), rng.randint(128, 384)) for _ in range(512)]
        return Workload.from_samples(self.low, pairs)

    def slo(self) -> SLO:
        return SLO(self.ttft_ms, self.itl_ms, self.percentile)

    def limits(self) -> Limits:
        return Limits(max_prefill=self.gpus - 1, max_decode=self.gpus - 1, budget=self.gpus)


def summarize(
    label: str, result: SimResult, slo: SLO, timeline: list[dict[str, float]]
) -> dict[str, Any]:
    """One side-by-side row from a simulator result."""
    end = result.duration_s
    ttft = result.latency("ttft_ms", slo.quantile, 0.0, end)
    itl = result.latency("itl_ms", slo.quantile, 0.0, end)
    return {
        "config": label,
        "requests": len([r for r in result.requests if r.arrival < end]),
        "attainment": result.attainment(slo, 0.0, end),
        "goodput_rps": result.goodput(slo, 0.0, end),
        "ttft_ms": None if math.isinf(ttft) else ttft,
        "itl_ms": None if math.isinf(itl) else itl,
        "worker_seconds": sum(result.worker_seconds.values()),
        "worker_seconds_by_role": result.worker_seconds,
        "scaling_actions": result.scale_actions,
        "max_workers": result.max_cost,
        "by_phase": {name: result.attainment(slo, a * end, b * end) for name, a, b in PHASES},
        "timeline": timeline,
    }


def _timeline(result: SimResult, start: tuple[int, int]) -> list[dict[str, float]]:
    """Serving workers per window (the fleet at t = 0 first)."""
    rows = [{"t": 0.0, "prefill": start[0], "decode": start[1], "rate": float("nan")}]
    for w in result.windows:
        rows.append({"t": w.t, "prefill": w.serving.prefill, "decode": w.serving.decode,
                     "rate": w.request_rate})  # fmt: skip
    return rows


def run_sim(setup: SimSetup, profile: Profile) -> dict[str, Any]:
    slo, limits, wl = setup.slo(), setup.limits(), setup.workload()
    schedule = RateSchedule.ramp(setup.low, setup.high, setup.duration_s)
    advice = advise(profile, wl.at_rate(setup.high), slo, limits, seed=setup.seed)
    best = advice.best or max(advice.candidates, key=lambda c: c.attainment)

    def fleet(p: int, d: int) -> SimConfig:
        return SimConfig(window_s=setup.window_s, startup_s=setup.startup_s, prefill=p,
                         decode=d, seed=setup.seed)  # fmt: skip

    rows = []
    # the planner's warm-up as a GPU worker's would be: two windows of a new worker are ignored
    planner = Planner(profile, slo, limits, PlannerConfig(warmup_s=2 * setup.window_s))
    auto = simulate(profile, wl, schedule, slo, planner=planner.step, limits=limits,
                    config=fleet(1, 1))  # fmt: skip
    rows.append(summarize("autoscale", auto, slo, _timeline(auto, (1, 1))))
    for label, (p, d) in (
        ("fixed 1P1D", (1, 1)),
        (f"fixed {best.label} (advisor)", (best.prefill, best.decode)),
    ):
        res = simulate(profile, wl, schedule, slo, config=fleet(p, d))
        rows.append(summarize(label, res, slo, _timeline(res, (p, d))))
    return {
        "setup": {**setup.__dict__, "workload": wl.describe(), "slo": slo.describe(),
                  "profile": f"{profile.model} on {profile.hardware} ({profile.note})"},
        "advisor_at_peak": {"best": best.label, "attainment": best.attainment,
                            "meets": advice.best is not None},
        "schedule": [list(p) for p in schedule.points],
        "rows": rows,
    }  # fmt: skip


def table(rows: list[dict[str, Any]], unit: str) -> str:
    """A markdown table of the side-by-side rows."""
    out = [
        f"| config | requests | SLO attainment | goodput req/s | TTFT ms | ITL ms |"
        f" {unit}-seconds | scaling actions | peak workers | attainment low/rise/peak/fall/low |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ms = lambda v: "never" if v is None else f"{v:.0f}"  # noqa: E731
        out.append(
            f"| {r['config']} | {r['requests']} | {100 * r['attainment']:.1f}% |"
            f" {r['goodput_rps']:.2f} | {ms(r['ttft_ms'])} | {ms(r['itl_ms'])} |"
            f" {r['worker_seconds']:.0f} | {r['scaling_actions']} | {r['max_workers']:g} |"
            f" {' / '.join(f'{100 * v:.0f}' for v in r['by_phase'].values())} |"
        )
    return "\n".join(out)


def plot_timeline(
    rows: list[dict[str, Any]], schedule: list[list[float]], title: str, path: Path
) -> None:
    """Workers over time per configuration (prefill and decode apart) against the offered
    request rate (right axis)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = ["tab:blue", "tab:gray", "tab:green", "tab:purple"]
    for ax, role in zip(axes, ("prefill", "decode"), strict=True):
        for i, r in enumerate(rows):
            tl = r["timeline"]
            ax.step([p["t"] for p in tl], [p[role] for p in tl], where="post",
                    color=colors[i % len(colors)], label=r["config"],
                    linewidth=2.2 if i == 0 else 1.3)  # fmt: skip
        ax.set_title(f"{role} workers")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        rate = ax.twinx()
        rate.plot([p[0] for p in schedule], [p[1] for p in schedule], color="tab:red",
                  linestyle="--", linewidth=1, label="offered load")  # fmt: skip
        rate.set_ylabel("offered requests/s", color="tab:red")
    axes[0].set_ylabel("workers serving")
    axes[0].legend(loc="upper left", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
