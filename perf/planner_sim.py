"""The simulated half of perf/planner_bench.py: a low -> high -> low ramp (or a sawtooth) on the
planner's simulated engine (services/control/planner/simulate.py) at a GPU host's scale, where the
budget leaves the planner room to move. The fleets go through one seeded arrival sequence:

- ``autoscale``: the SLA planner (``Planner.step``) every window, within the budget, with its
  warm pool (the floor ``warm_prefill`` / ``warm_decode``, loaded at the start like the fleet);
- ``fixed 1P1D``: the fleet ``pdserve up`` starts by default;
- ``fixed best``: the P:D the offline advisor (``pdserve plan``'s ``advise``) picks for the
  ramp's *peak* rate within the same budget, held all the way through (what one would deploy
  without a planner, sized for the worst hour): the GPU-seconds autoscale is measured against.

The planner is told what ``pdserve plan`` knows of the workload (its prompts' service-time
variability, as the advisor's closed form uses it) and the start latencies as priors; it
measures them itself as workers start. perf/planner_targets.py sweeps seeds, steepness and a
sawtooth. Also the shared row and plot helpers the CPU half uses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.services.control.planner.advisor import advise, service_cv2
from pdserve.services.control.planner.decide import Planner
from pdserve.services.control.planner.inputs import Counts, Limits, PlannerConfig
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import RateSchedule, SimConfig, SimResult
from pdserve.services.control.planner.simulate import simulate
from pdserve.services.control.planner.workload import SLO, Workload

# the ramp's phases (RateSchedule.ramp's shape at steepness 1), for attainment by phase
PHASES = (
    ("low", 0.0, 0.1),
    ("rise", 0.1, 0.4),
    ("peak", 0.4, 0.6),
    ("fall", 0.6, 0.9),
    ("low again", 0.9, 1.0),
)


@dataclass(frozen=True)
class SimSetup:
    """The GPU-host load. ISL 512-1536 and OSL 128-384 (uniform, mean 1024 / 256) are a chat-like
    mix; the SLO is an interactive one for an 8B model on an H200. ``steepness`` s takes the
    ramp's rise and fall s times as fast about the same peak (RateSchedule.ramp);
    ``sawtooth_s`` > 0 replaces the ramp by a sawtooth low <-> high turning every that many
    seconds."""

    gpus: int = 8
    low: float = 8.0  # requests/s
    high: float = 80.0
    duration_s: float = 900.0
    steepness: float = 1.0
    sawtooth_s: float = 0.0
    window_s: float = 10.0  # the planner's interval (--autoscale-interval's default)
    startup_s: float = 60.0  # a GPU worker's model load, from "start" to its first request
    promote_s: float = 1.0  # a pooled worker's promotion (SIGUSR1) to its first request
    warm_prefill: int = 1  # the warm pool's floor (--warm-prefill-workers)
    warm_decode: int = 0
    ttft_ms: float = 500.0
    itl_ms: float = 20.0
    percentile: str = "p90"
    seed: int = 0
    # prefill workers serve prompts past the TTFT target after the on-time ones, as pdserve up
    # --autoscale sets --prompt-deadline-ms (False: arrival order, the engine's default)
    prompt_deadline: bool = True

    def workload(self) -> Workload:
        rng = random.Random(self.seed)
        pairs = [(rng.randint(512, 1536), rng.randint(128, 384)) for _ in range(512)]
        return Workload.from_samples(self.low, pairs)

    def slo(self) -> SLO:
        return SLO(self.ttft_ms, self.itl_ms, self.percentile)

    def limits(self) -> Limits:
        return Limits(max_prefill=self.gpus - 1, max_decode=self.gpus - 1, budget=self.gpus)

    def schedule(self) -> RateSchedule:
        if self.sawtooth_s > 0:
            return RateSchedule.sawtooth(self.low, self.high, self.sawtooth_s, self.duration_s)
        return RateSchedule.ramp(self.low, self.high, self.duration_s, self.steepness)

    def phases(self) -> tuple[tuple[str, float, float], ...]:
        """(name, start s, end s): the ramp's five, or the sawtooth's rising and falling halves
        taken together."""
        if self.sawtooth_s > 0:
            return (("all", 0.0, self.duration_s),)
        return self.schedule().ramp_phases()

    def pool(self) -> Counts:
        return Counts(self.warm_prefill, self.warm_decode)

    def planner(self, profile: Profile, workload: Workload) -> Planner:
        config = PlannerConfig(
            warmup_s=2 * self.window_s,  # two windows of a new worker's latencies are ignored
            prefill_cv2=service_cv2(profile, workload),
            cold_start_s=self.startup_s,
            warm_start_s=self.promote_s,
            pool_floor=self.pool(),
        )
        return Planner(profile, self.slo(), self.limits(), config)


def summarize(
    label: str,
    result: SimResult,
    slo: SLO,
    timeline: list[dict[str, float]],
    phases: tuple[tuple[str, float, float], ...] = (),
) -> dict[str, Any]:
    """One side-by-side row from a simulator result."""
    end = result.duration_s
    ttft = result.latency("ttft_ms", slo.quantile, 0.0, end)
    itl = result.latency("itl_ms", slo.quantile, 0.0, end)
    phases = phases or tuple((n, a * end, b * end) for n, a, b in PHASES)
    return {
        "config": label,
        "requests": len([r for r in result.requests if r.arrival < end]),
        "attainment": result.attainment(slo, 0.0, end),
        "goodput_rps": result.goodput(slo, 0.0, end),
        "ttft_ms": None if math.isinf(ttft) else ttft,
        "itl_ms": None if math.isinf(itl) else itl,
        "worker_seconds": sum(result.worker_seconds.values()),
        "worker_seconds_by_role": result.worker_seconds,
        "pool_seconds": result.pool_seconds,
        "scaling_actions": result.scale_actions,
        "pool_actions": result.pool_actions,
        "max_workers": result.max_cost,
        "by_phase": {name: result.attainment(slo, a, b) for name, a, b in phases},
        "timeline": timeline,
    }


def _timeline(result: SimResult, start: tuple[int, int]) -> list[dict[str, Any]]:
    """Serving and pooled workers per window (the fleet at t = 0 first)."""
    rows: list[dict[str, Any]] = [
        {"t": 0.0, "prefill": start[0], "decode": start[1], "rate": float("nan")}
    ]
    for w in result.windows:
        rows.append(
            {
                "t": w.t,
                "prefill": w.serving.prefill,
                "decode": w.serving.decode,
                "pool_prefill": w.pool.prefill,
                "pool_decode": w.pool.decode,
                "rate": w.request_rate,
                "forecast": w.forecast,
            }
        )
    return rows


def run_sim(
    setup: SimSetup, profile: Profile, fixed: bool = True, advised: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Autoscale through the setup's load; with ``fixed``, 1P1D and the advisor's fleet too.
    ``advised``: the advisor's P:D when already known (it takes seconds to compute)."""
    slo, limits, wl, schedule = setup.slo(), setup.limits(), setup.workload(), setup.schedule()
    advice = None
    if advised is None:
        advice = advise(profile, wl.at_rate(setup.high), slo, limits, seed=setup.seed)
        best = advice.best or max(advice.candidates, key=lambda c: c.attainment)
        advised = (best.prefill, best.decode)

    def fleet(p: int, d: int, pool: Counts = Counts(0, 0)) -> SimConfig:
        return SimConfig(
            window_s=setup.window_s,
            startup_s=setup.startup_s,
            prefill=p,
            decode=d,
            seed=setup.seed,
            promote_s=setup.promote_s,
            pool=pool,
            prompt_deadline_s=setup.ttft_ms / 1000 if setup.prompt_deadline else 0.0,
        )

    auto = simulate(
        profile,
        wl,
        schedule,
        slo,
        planner=setup.planner(profile, wl).step,
        limits=limits,
        config=fleet(1, 1, setup.pool()),
    )
    rows = [summarize("autoscale", auto, slo, _timeline(auto, (1, 1)), setup.phases())]
    rows[0]["flaps"] = auto.reversals(3 * (setup.startup_s + setup.window_s))
    rows[0]["advisor_seconds"] = (advised[0] + advised[1]) * schedule.duration
    fleets = [("fixed 1P1D", (1, 1))] if fixed else []
    fleets += [(f"fixed {advised[0]}P{advised[1]}D (advisor)", advised)] if fixed else []
    for label, (p, d) in fleets:
        res = simulate(profile, wl, schedule, slo, config=fleet(p, d))
        rows.append(summarize(label, res, slo, _timeline(res, (p, d)), setup.phases()))
    return {
        "setup": {
            **setup.__dict__,
            "workload": wl.describe(),
            "slo": slo.describe(),
            "profile": f"{profile.model} on {profile.hardware} ({profile.note})",
        },
        "advisor_at_peak": {
            "best": f"{advised[0]}P{advised[1]}D",
            "attainment": advice.best.attainment if advice and advice.best else None,
            "meets": advice.best is not None if advice else None,
        },
        "advised": list(advised),
        "schedule": [list(p) for p in schedule.points],
        "rows": rows,
    }


def table(rows: list[dict[str, Any]], unit: str) -> str:
    """A markdown table of the side-by-side rows."""
    phases = "/".join(rows[0]["by_phase"]) if rows else ""
    out = [
        f"| config | requests | SLO attainment | goodput req/s | TTFT ms | ITL ms |"
        f" {unit}-seconds | scaling actions | peak workers | attainment {phases} |",
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
            ax.step(
                [p["t"] for p in tl],
                [p[role] for p in tl],
                where="post",
                color=colors[i % len(colors)],
                label=r["config"],
                linewidth=2.2 if i == 0 else 1.3,
            )
            if any(p.get(f"pool_{role}") for p in tl):  # the warm pool beside the serving
                ax.step(
                    [p["t"] for p in tl],
                    [p.get(f"pool_{role}", 0) for p in tl],
                    where="post",
                    color=colors[i % len(colors)],
                    linestyle=":",
                    linewidth=1.3,
                    label=f"{r['config']}: warm pool",
                )
        ax.set_title(f"{role} workers")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        rate = ax.twinx()
        rate.plot(
            [p[0] for p in schedule],
            [p[1] for p in schedule],
            color="tab:red",
            linestyle="--",
            linewidth=1,
            label="offered load",
        )
        rate.set_ylabel("offered requests/s", color="tab:red")
    axes[0].set_ylabel("workers serving (dotted: pooled)")
    axes[0].legend(loc="upper left", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
