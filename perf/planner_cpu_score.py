"""How perf/planner_bench.py scores a CPU ramp run: per request, the SLO met or not (a failed
request misses), the good share overall and by phase, the p90 latencies, and the worker-seconds
integrated from the planner's timeline (a fixed 1P1D: two workers throughout)."""

from __future__ import annotations

import math
from typing import Any

from pdserve.services.control.bench.client import RequestRecord
from pdserve.services.control.planner.workload import SLO
from perf.planner_sim import PHASES

CPU_SLO = SLO(2000.0, 150.0, "p90")


def row(
    label: str,
    records: list[RequestRecord],
    timeline: list[dict[str, float]],
    duration: float,
    fixed: bool,
) -> dict[str, Any]:
    q = CPU_SLO.quantile

    def per_request(r: RequestRecord) -> tuple[float, float]:
        if not r.success:
            return math.inf, math.inf
        return 1000 * r.ttft, 1000 * (sum(r.itl) / len(r.itl) if r.itl else 0.0)

    lat = [per_request(r) for r in records]
    good = sum(1 for t, i in lat if CPU_SLO.met_by(t, i))

    def phase(a: float, b: float) -> float:
        span = [x for r, x in zip(records, lat, strict=True) if a <= r.start_time < b]
        return sum(1 for t, i in span if CPU_SLO.met_by(t, i)) / len(span) if span else 1.0

    def pct(k: int) -> float | None:
        v = sorted(x[k] for x in lat)
        got = v[min(len(v) - 1, math.ceil(q * len(v)) - 1)] if v else 0.0
        return None if math.isinf(got) else got

    if fixed:
        timeline = [
            {"t": 0.0, "prefill": 1, "decode": 1, "draining": 0, "actions": 0},
            {"t": duration, "prefill": 1, "decode": 1, "draining": 0, "actions": 0},
        ]
    # worker-seconds within the ramp: serving and draining workers, each sample held a step
    ws = 0.0
    for a, b in zip(timeline, timeline[1:], strict=False):
        t0, t1 = min(a["t"], duration), min(b["t"], duration)
        ws += max(0.0, t1 - t0) * (a["prefill"] + a["decode"] + a["draining"])
    return {
        "config": label,
        "requests": len(records),
        "failed": sum(1 for r in records if not r.success),
        "attainment": good / len(records) if records else 1.0,
        "goodput_rps": good / duration,
        "ttft_ms": pct(0),
        "itl_ms": pct(1),
        "worker_seconds": ws,
        "scaling_actions": int(timeline[-1]["actions"]) if timeline else 0,
        "max_workers": max(
            (p["prefill"] + p["decode"] + p["draining"] for p in timeline), default=0
        ),
        "by_phase": {name: phase(a * duration, b * duration) for name, a, b in PHASES},
        "timeline": timeline,
        "errors": sorted({r.error[:120] for r in records if r.error})[:5],
    }
