"""The offline advice of ``pdserve plan``: how many prefill and decode workers a workload needs,
and whether one aggregated pool would do better.

1. The closed form (sizing.py) gives a first answer from the profile: P from the prefill load and
   the TTFT percentile a pool of P meets, D from the largest batch whose ITL meets the SLO.
2. Every P:D around it (up to two more of each, within the limits and the budget) runs through the
   simulator at the workload's rate; attainment is the share of requests that meet both targets,
   measured after a warm-up tenth of the run. The closed form ignores what the simulator sees (the
   KV transfer, requests of different lengths sharing a batch, a decode queue), so the simulated
   attainment decides.
3. The cheapest P:D whose attainment reaches the target (the SLO's percentile: 99% for p99) wins;
   among equal costs, the higher attainment.
4. Aggregated serving, N workers doing both phases (prefill chunks interleaved with the decode
   steps, each step's ITL inflated by its chunk), runs through the same simulator, N = 1, 2, ...
   until one meets the target. The verdict compares the two cheapest answers.

Everything is printed as arithmetic (``Advice.report()``), and ``plot_attainment`` draws
attainment against P:D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.services.control.planner.inputs import Counts, Limits
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.sim_data import RateSchedule, SimConfig, SimResult
from pdserve.services.control.planner.simulate import simulate
from pdserve.services.control.planner.sizing import size_decode, size_prefill
from pdserve.services.control.planner.workload import SLO, Workload


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    aggregated: int  # > 0: an aggregated pool of this many workers (prefill = decode = 0)
    cost: float
    attainment: float
    ttft_ms: float  # per-request TTFT at the SLO's percentile (inf: some never finished)
    itl_ms: float  # per-request mean ITL at the SLO's percentile
    goodput: float  # requests/s meeting the SLO

    @property
    def label(self) -> str:
        return f"agg x{self.aggregated}" if self.aggregated else f"{self.prefill}P{self.decode}D"


@dataclass
class Advice:
    workload: Workload
    slo: SLO
    target: float  # attainment a candidate must reach
    closed_form: Counts
    lines: list[str] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)  # disaggregated, by cost
    aggregated: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    best_aggregated: Candidate | None = None

    def report(self) -> str:
        return "\n".join(self.lines) + "\n"


def service_cv2(profile: Profile, workload: Workload) -> float:
    """The squared coefficient of variation of prefill service times over the workload's
    samples (0 for fixed lengths): the TTFT queue model's variability."""
    if not workload.samples:
        return 0.0
    times = [profile.prefill_seconds(isl) for isl, _ in workload.samples]
    mean = sum(times) / len(times)
    return sum((t - mean) ** 2 for t in times) / len(times) / mean**2


def _measure(
    result: SimResult, slo: SLO, counts: tuple[int, int, int], cost: float, warm: float
) -> Candidate:
    q, end = slo.quantile, result.duration_s
    return Candidate(
        *counts,
        cost=cost,
        attainment=result.attainment(slo, warm, end),
        ttft_ms=result.latency("ttft_ms", q, warm, end),
        itl_ms=result.latency("itl_ms", q, warm, end),
        goodput=result.goodput(slo, warm, end),
    )


def _row(c: Candidate, target: float) -> str:
    ok = "meets" if c.attainment >= target else ""
    ttft = "never" if math.isinf(c.ttft_ms) else f"{c.ttft_ms:.0f}"
    itl = "never" if math.isinf(c.itl_ms) else f"{c.itl_ms:.1f}"
    return (
        f"  {c.label:>9} {c.cost:6g} {100 * c.attainment:7.1f}% {ttft:>9} {itl:>8}"
        f" {c.goodput:8.2f}  {ok}"
    )


def advise(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    limits: Limits,
    *,
    target: float | None = None,
    duration_s: float = 120.0,
    seed: int = 0,
    sim: SimConfig = SimConfig(),
) -> Advice:
    target = slo.quantile if target is None else target
    rate, isl, osl = workload.request_rate, workload.isl, workload.osl
    cv2 = service_cv2(profile, workload)
    pre = size_prefill(profile, rate, isl, slo, cv2=cv2)
    dec = size_decode(profile, rate, isl, osl, slo)
    closed = Counts(max(pre.workers, limits.min_prefill), max(dec.workers, limits.min_decode))
    advice = Advice(workload=workload, slo=slo, target=target, closed_form=closed)
    unit = limits.unit
    out = advice.lines
    out += [
        f"workload: {workload.describe()}",
        f"SLO: {slo.describe()}; a configuration meets it when >= {target:.0%} of requests do",
        f"profile: {profile.model or '?'} on {profile.hardware or '?'}"
        + (f" ({profile.note})" if profile.note else ""),
        "closed form:",
        f"  {pre.explain()}",
        f"  {dec.explain()}",
        f"  -> {closed} ({limits.cost(closed):g} {unit})",
    ]
    if not profile.covers(isl, dec.context):
        out.append("  note: the workload's lengths lie outside the profile: its ends are clamped")

    schedule = RateSchedule.constant(rate, duration_s)
    warm = duration_s / 10

    def run(p: int, d: int, a: int) -> Candidate:
        cfg = SimConfig(
            window_s=sim.window_s,
            kv_transfer_ms=sim.kv_transfer_ms,
            prefill=p,
            decode=d,
            aggregated=a,
            chunk_tokens=sim.chunk_tokens,
            tail_s=sim.tail_s,
            seed=seed,
        )
        result = simulate(profile, workload, schedule, slo, config=cfg)
        cost = limits.cost(Counts(p, d)) + a * limits.decode_cost
        return _measure(result, slo, (p, d, a), cost, warm)

    within = limits.budget if limits.budget is not None else math.inf
    for p in range(max(1, limits.min_prefill), min(limits.max_prefill, closed.prefill + 2) + 1):
        for d in range(max(1, limits.min_decode), min(limits.max_decode, closed.decode + 2) + 1):
            if limits.cost(Counts(p, d)) <= within + 1e-9:
                advice.candidates.append(run(p, d, 0))
    advice.candidates.sort(key=lambda c: (c.cost, c.prefill))
    meeting = [c for c in advice.candidates if c.attainment >= target]
    advice.best = min(meeting, key=lambda c: (c.cost, -c.attainment), default=None)

    most = min(limits.max_prefill + limits.max_decode, int(within / limits.decode_cost + 1e-9))
    for n in range(1, most + 1):
        advice.aggregated.append(run(0, 0, n))
        if advice.aggregated[-1].attainment >= target:
            break
    advice.best_aggregated = next((c for c in advice.aggregated if c.attainment >= target), None)

    head = f"  {'config':>9} {unit:>6} {'attain':>8} {'TTFT ms':>9} {'ITL ms':>8} {'goodput':>8}"
    out += [
        f"simulated: {duration_s:g} s at {rate:g} req/s (seed {seed}), measured after"
        f" {warm:g} s; TTFT and ITL per request at {slo.percentile}, goodput in req/s:",
        head,
        *(_row(c, target) for c in advice.candidates),
        f"aggregated ({sim.chunk_tokens}-token prefill chunks interleaved with decode steps):",
        head,
        *(_row(c, target) for c in advice.aggregated),
    ]
    out += _verdict(advice, unit)
    return advice


def _verdict(advice: Advice, unit: str) -> list[str]:
    best, agg = advice.best, advice.best_aggregated
    lines = []
    if best is None:
        top = max(advice.candidates, key=lambda c: c.attainment, default=None)
        lines.append(
            "recommendation: no P:D within the limits meets the SLO"
            + (f"; the closest is {top.label} at {100 * top.attainment:.1f}%" if top else "")
        )
    else:
        lines.append(
            f"recommendation: {best.label} ({best.cost:g} {unit}): attainment"
            f" {100 * best.attainment:.1f}%, goodput {best.goodput:.2f} req/s"
        )
    if agg is None:
        lines.append("aggregated: no pool within the limits meets the SLO")
    elif best is None or agg.cost < best.cost:
        lines.append(
            f"aggregated serving does better: {agg.label} ({agg.cost:g} {unit}) meets the SLO at"
            f" {100 * agg.attainment:.1f}%"
        )
    else:
        saved = agg.cost - best.cost
        lines.append(
            f"aggregated serving needs {agg.label} ({agg.cost:g} {unit}) for the same SLO:"
            f" disaggregation saves {saved:g} {unit}"
            + (" (a tie: aggregated is simpler to run)" if saved == 0 else "")
        )
    return lines


def plot_attainment(advice: Advice, path: Path | str) -> None:
    """Attainment of every simulated configuration, by cost, with the target as a line."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    rows = advice.candidates + advice.aggregated
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2), 4.2))
    colors = ["tab:orange" if c.aggregated else "tab:blue" for c in rows]
    ax.bar(range(len(rows)), [100 * c.attainment for c in rows], color=colors)
    ax.set_xticks(range(len(rows)), [f"{c.label}\n{c.cost:g}" for c in rows], fontsize=7)
    ax.axhline(100 * advice.target, color="tab:red", linestyle="--", label="target")
    for i, c in enumerate(rows):
        if c in (advice.best, advice.best_aggregated):
            ax.annotate("best", (i, 100 * c.attainment), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel(f"SLO attainment (%, {advice.slo.percentile})")
    ax.set_xlabel("configuration / cost (blue: disaggregated P:D, orange: aggregated)")
    ax.set_ylim(0, 105)
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 1.12), fontsize=7, frameon=False)
    fig.suptitle(f"{advice.workload.describe()}; {advice.slo.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
