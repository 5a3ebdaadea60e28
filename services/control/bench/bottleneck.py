"""The "bottleneck" section of a bench run: which roof each phase's forward passes hit.

pdserve's gateway re-exports, per worker, what its forward passes computed, moved and took
(``pdserve_step_{flops,bytes,busy_seconds}_total``, labelled worker, role and phase: a pass with
any prompt chunk is "prefill", else "decode") and the peaks the worker measured on its device
(``pdserve_peak_{flops,bytes}_per_second``, labelled worker and role); see
``shared/telemetry/roofline_metrics.py``. Read before and after a run, the differences are the
run's, and per phase, summed over the workers:

- achieved FLOP/s and bytes/s over the busy (forward-pass) seconds, and their intensity;
- the fraction of each roof: the work done over what the roofs allowed in the same busy time,
  ``sum(flops) / sum(busy_w x peak_w)``, so workers on different devices weigh by their time
  (on one device it is simply achieved / peak);
- the bound (the intensity against the ridge of those busy-weighted roofs) and one line of advice
  (``roofline.advice``).

Only workers that report peaks enter the fractions; the totals count every worker. A server that
exposes none of these series (vLLM, or a pdserve older than issue 34) gets no section.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.shared.telemetry.roofline import PHASES, Cost, Peaks, advice, roofline
from pdserve.shared.telemetry.roofline_metrics import LOAD_COUNTERS, LOAD_GAUGES

# family name (as the parser gives a counter: without "_total") -> index in a totals triple
COUNTER_INDEX = {name: i for i, (_, name, _) in enumerate(LOAD_COUNTERS)}  # flops, bytes, busy
GAUGE_INDEX = {name: i for i, (_, name, _) in enumerate(LOAD_GAUGES)}  # peak flops, peak bytes

Totals = tuple[float, float, float]  # flops, bytes, busy seconds


@dataclass
class Snapshot:
    """The gateway's roofline series at one moment."""

    # (worker, role, phase) -> what its forward passes computed, moved and took since start
    totals: dict[tuple[str, str, str], Totals] = field(default_factory=dict)
    # (worker, role) -> its measured peaks (FLOP/s, bytes/s); absent: never measured
    peaks: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)


def parse_roofline(text: str) -> Snapshot | None:
    """The roofline series in a Prometheus text page, or None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    snap, found = Snapshot(), False
    totals: dict[tuple[str, str, str], list[float]] = {}
    peaks: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        base = family.name.removesuffix("_total")
        if base in COUNTER_INDEX:
            found = True
            for s in family.samples:
                if s.name == base + "_total":
                    key = (
                        s.labels.get("worker", ""),
                        s.labels.get("role", ""),
                        s.labels.get("phase", ""),
                    )
                    totals.setdefault(key, [0.0, 0.0, 0.0])[COUNTER_INDEX[base]] += s.value
        elif family.name in GAUGE_INDEX:
            found = True
            for s in family.samples:
                key2 = (s.labels.get("worker", ""), s.labels.get("role", ""))
                peaks.setdefault(key2, [0.0, 0.0])[GAUGE_INDEX[family.name]] = s.value
    if not found:
        return None
    snap.totals = {k: (v[0], v[1], v[2]) for k, v in totals.items()}
    snap.peaks = {k: (v[0], v[1]) for k, v in peaks.items() if v[0] > 0 and v[1] > 0}
    return snap


@dataclass
class PhaseBottleneck:
    """One phase's forward passes during a run, against the roofs of the workers that ran them."""

    phase: str
    workers: list[str]  # the workers that ran passes of this phase during the run
    flops: float
    bytes: float
    busy_seconds: float
    intensity: float  # FLOP/byte
    flops_per_s: float  # achieved, over the busy seconds
    bytes_per_s: float
    # against the measured peaks (None when no worker of the phase reported any)
    peak_flops_per_s: float | None = None  # busy-weighted over the workers with peaks
    peak_bytes_per_s: float | None = None
    ridge: float | None = None
    compute_fraction: float | None = None
    bandwidth_fraction: float | None = None
    bound: str | None = None  # "compute" or "memory"
    advice: str | None = None
    unmeasured_workers: list[str] = field(default_factory=list)  # ran passes, reported no peaks


def _delta(after: Totals, before: Totals | None) -> Totals:
    if before is None:
        return after  # a worker that joined during the run: all of its passes are the run's
    d = tuple(a - b for a, b in zip(after, before, strict=True))
    # a counter went down: the worker restarted under its id; count what it did since (as
    # Prometheus' rate() treats a reset)
    return after if min(d) < 0 else (d[0], d[1], d[2])


def bottleneck(before: Snapshot, after: Snapshot) -> dict[str, PhaseBottleneck]:
    """Each phase that ran forward passes between the two snapshots (see the module docstring).
    A worker gone by ``after`` is not counted: its last totals are unknown."""
    out: dict[str, PhaseBottleneck] = {}
    for phase in PHASES:
        sums = [0.0, 0.0, 0.0]
        measured = [0.0, 0.0, 0.0]  # flops, bytes, busy of the workers with peaks
        attainable = [0.0, 0.0]  # busy x peak FLOP/s, busy x peak bytes/s
        workers: list[str] = []
        unmeasured: list[str] = []
        for key, now in sorted(after.totals.items()):
            worker, role, key_phase = key
            if key_phase != phase:
                continue
            d = _delta(now, before.totals.get(key))
            if d[2] <= 0:
                continue
            workers.append(worker)
            sums = [s + x for s, x in zip(sums, d, strict=True)]
            peak = after.peaks.get((worker, role))
            if peak is None:
                unmeasured.append(worker)
                continue
            measured = [s + x for s, x in zip(measured, d, strict=True)]
            attainable = [attainable[0] + d[2] * peak[0], attainable[1] + d[2] * peak[1]]
        if not workers:
            continue
        flops, moved, busy = sums
        b = PhaseBottleneck(
            phase=phase,
            workers=workers,
            flops=flops,
            bytes=moved,
            busy_seconds=busy,
            intensity=Cost(flops, moved).intensity,
            flops_per_s=flops / busy,
            bytes_per_s=moved / busy,
            unmeasured_workers=unmeasured,
        )
        if measured[2] > 0:
            peaks = Peaks(
                flops_per_s=attainable[0] / measured[2],
                bytes_per_s=attainable[1] / measured[2],
                device="",
                dtype="",
                threads=0,
                measured_at=0,
            )
            r = roofline(Cost(measured[0], measured[1]), measured[2], peaks)
            b.peak_flops_per_s, b.peak_bytes_per_s = peaks.flops_per_s, peaks.bytes_per_s
            b.ridge = peaks.ridge
            b.compute_fraction, b.bandwidth_fraction = r.compute_fraction, r.bandwidth_fraction
            b.bound, b.advice = r.bound, advice(phase, r)
        out[phase] = b
    return out


def as_dicts(phases: Mapping[str, PhaseBottleneck]) -> dict[str, dict[str, Any]]:
    """The JSON form (a run's ``metrics.bottleneck``)."""
    return {phase: asdict(b) for phase, b in phases.items()}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def summary_lines(phases: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The printed section (``phases``: a run's ``metrics.bottleneck``); none without phases."""
    if not phases:
        return []
    lines = ["bottleneck (forward passes during the run, against the workers' measured peaks):"]
    for phase, b in phases.items():
        n = len(b["workers"])
        busy = f"{b['busy_seconds']:.2f} s busy on {n} worker{'s' if n != 1 else ''}"
        achieved = (
            f"{_rate(b['flops_per_s'], 'FLOP/s')}, {_rate(b['bytes_per_s'], 'B/s')}, "
            f"intensity {b['intensity']:.1f} FLOP/B"
        )
        if b["bound"] is None:
            lines.append(f"  {phase}: {achieved}, {busy}; no peaks reported")
            continue
        lines.append(
            f"  {phase}: {b['bound']}-bound: {_pct(b['compute_fraction'])} of peak compute, "
            f"{_pct(b['bandwidth_fraction'])} of peak bandwidth ({achieved}, ridge "
            f"{b['ridge']:.1f}), {busy}"
        )
        lines.append(f"    {b['advice']}")
        if b["unmeasured_workers"]:
            lines.append(
                f"    (without peaks, left out of the fractions: "
                f"{', '.join(b['unmeasured_workers'])})"
            )
    return lines


def markdown(runs: Sequence[tuple[str, Mapping[str, Mapping[str, Any]]]]) -> str:
    """A table of every (run label, bottleneck) with phases, and each phase's advice; empty
    when no run has any."""
    rows = [(label, phase, b) for label, phases in runs for phase, b in phases.items()]
    if not rows:
        return ""
    head = [
        "run",
        "phase",
        "busy s",
        "FLOP/byte",
        "ridge",
        "achieved FLOP/s",
        "of peak compute",
        "achieved B/s",
        "of peak bandwidth",
        "bound",
    ]
    lines = [
        "## Bottleneck",
        "",
        "Forward passes during each run, summed over the workers, against the peaks each "
        "worker measured on its device (`pdserve doctor`'s, or its own quick measurement "
        "at start).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for label, phase, b in rows:
        ridge = "-" if b["ridge"] is None else f"{b['ridge']:.1f}"
        intensity = b["intensity"]
        shown = (
            f"{intensity:.1f}" if isinstance(intensity, float) and math.isfinite(intensity) else "-"
        )
        lines.append(
            f"| {label} | {phase} | {b['busy_seconds']:.2f} | {shown} | {ridge} | "
            f"{_rate(b['flops_per_s'], 'FLOP/s')} | {_pct(b['compute_fraction'])} | "
            f"{_rate(b['bytes_per_s'], 'B/s')} | {_pct(b['bandwidth_fraction'])} | "
            f"{b['bound'] or '-'} |"
        )
    lines.append("")
    lines += [f"- {label}, {phase}: {b['advice']}" for label, phase, b in rows if b["advice"]]
    return "\n".join(lines) + "\n"
