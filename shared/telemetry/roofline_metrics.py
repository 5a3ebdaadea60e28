"""The roofline's Prometheus series: per worker step (``RooflineMetrics``, part of
``WorkerMetrics``) and their re-export by the gateway from the workers' heartbeats
(``roofline_families``, part of ``WorkerLoadCollector``). The arithmetic is ``roofline.py``'s.

Worker series carry ``role`` and ``phase`` (a step with any prefill rows is "prefill", else
"decode"); the peak gauges ``role`` only. Counters add up what the forward passes computed and
moved and how long they took, so any window's achieved FLOP/s and bytes/s, against the peak
gauges, are one ``rate()`` away; the histograms tell the spread of single steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.shared.telemetry.roofline import PHASES, Cost, Peaks, Roofline, roofline

log = logging.getLogger(__name__)

# A step's fraction of a roof: a few % (tiny batches, overheads) up to the roof; a little past it
# is measurement noise (the peaks are measured too), far past it a wrong count.
FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)
# FLOP per byte: batch-1 decode sits near 1 (fp32) or 2 (bf16, INT8); a long prompt chunk in the
# hundreds or thousands. Doubling buckets, as ridges span ~5 (a CPU) to ~300 (a GPU in bf16).
INTENSITY_BUCKETS = tuple(2.0**k for k in range(-2, 13))


class StepLike(Protocol):
    """The fields of ``services.engine.outputs.StepStats`` read here."""

    seconds: float
    flops: float
    bytes: float

    @property
    def phase(self) -> str: ...


class RooflineMetrics:
    """A worker's roofline series, its running totals per phase, and its peaks (None until
    loaded: then only the counters and the intensity are kept)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role
        self.peaks: Peaks | None = None
        # phase -> [flops, bytes, seconds] of its forward passes since start (the heartbeat's)
        self.totals = {phase: [0.0, 0.0, 0.0] for phase in PHASES}
        self._decode_before = (0.0, 0.0, 0.0)  # the decode totals before the latest step
        labels = ["role", "phase"]

        def counter(name: str, doc: str) -> dict[str, Any]:
            family = Counter(name, doc, labels, registry=registry)
            return {phase: family.labels(role, phase) for phase in PHASES}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> dict[str, Any]:
            family = Histogram(name, doc, labels, buckets=buckets, registry=registry)
            return {phase: family.labels(role, phase) for phase in PHASES}

        self.flops = counter(
            "pdserve_worker_step_flops",
            "FLOPs of the forward passes (analytic: linear layers, attention, LM head).",
        )
        self.bytes = counter(
            "pdserve_worker_step_bytes",
            "Bytes the forward passes moved (analytic: weights as stored, embeddings, KV read "
            "and written).",
        )
        self.busy = counter("pdserve_worker_step_busy_seconds", "Wall time of the forward passes.")
        self.compute_fraction = hist(
            "pdserve_worker_step_compute_fraction",
            "Achieved FLOP/s of one forward pass over this device's measured peak.",
            FRACTION_BUCKETS,
        )
        self.bandwidth_fraction = hist(
            "pdserve_worker_step_bandwidth_fraction",
            "Achieved bytes/s of one forward pass over this device's measured peak bandwidth.",
            FRACTION_BUCKETS,
        )
        self.intensity = hist(
            "pdserve_worker_step_arithmetic_intensity",
            "FLOPs per byte moved of one forward pass (below the ridge: memory-bound).",
            INTENSITY_BUCKETS,
        )
        self.peak_flops = Gauge(
            "pdserve_worker_peak_flops_per_second",
            "This device's measured peak dense GEMM FLOP/s at the model's dtype.",
            ["role"],
            registry=registry,
        ).labels(role)
        self.peak_bytes = Gauge(
            "pdserve_worker_peak_bytes_per_second",
            "This device's measured peak memory-read bandwidth.",
            ["role"],
            registry=registry,
        ).labels(role)

    def set_peaks(self, peaks: Peaks) -> None:
        self.peaks = peaks
        self.peak_flops.set(peaks.flops_per_s)
        self.peak_bytes.set(peaks.bytes_per_s)

    def load_peaks(self, device: object, dtype: object, threads: int) -> None:
        """The cached peaks of ``device`` (a torch.device or its name) at ``dtype`` (a
        torch.dtype or its name) and ``threads``, else a quick measurement (``peaks.py``): at
        start, before serving. Telemetry never stops a worker: without peaks it keeps the
        counters and the intensity."""
        from pdserve.shared.telemetry.peaks import load_or_measure

        device, dtype = str(device), str(dtype).removeprefix("torch.")
        try:
            self.set_peaks(load_or_measure(device, dtype, 0 if device != "cpu" else threads))
        except Exception as exc:
            log.warning(
                "no roofline peaks for %s %s (%r): fractions not reported", device, dtype, exc
            )
            return
        p = self.peaks
        log.info(
            "roofs of %s: %.3g FLOP/s (%s), %.3g B/s, ridge %.1f FLOP/B",
            p.device,
            p.flops_per_s,
            p.dtype,
            p.bytes_per_s,
            p.ridge,
        )

    def step(self, stats: StepLike) -> Roofline | None:
        """Account one engine step (on the worker's event loop); its roofline, when it ran a
        forward pass and the peaks are known."""
        self._decode_before = tuple(self.totals["decode"])
        if stats.seconds <= 0:  # no forward pass: the step only applied commands
            return None
        phase = stats.phase
        totals = self.totals[phase]
        totals[0] += stats.flops
        totals[1] += stats.bytes
        totals[2] += stats.seconds
        self.flops[phase].inc(stats.flops)
        self.bytes[phase].inc(stats.bytes)
        self.busy[phase].inc(stats.seconds)
        cost = Cost(stats.flops, stats.bytes)
        if stats.bytes > 0:
            self.intensity[phase].observe(cost.intensity)
        if self.peaks is None:
            return None
        r = roofline(cost, stats.seconds, self.peaks)
        self.compute_fraction[phase].observe(r.compute_fraction)
        self.bandwidth_fraction[phase].observe(r.bandwidth_fraction)
        return r

    def decode_mark(self) -> tuple[float, float, float]:
        """The decode totals before the latest step: a request whose first output came from
        that step starts its decode lifetime here (``since``)."""
        return self._decode_before

    def since(self, mark: tuple[float, float, float] | None) -> Roofline | None:
        """The roofline of the decode steps since ``mark`` (a request's decode lifetime): O(1),
        counter deltas. None without peaks, or when no decode step ran since."""
        if mark is None or self.peaks is None:
            return None
        flops, moved, seconds = (
            now - then for now, then in zip(self.totals["decode"], mark, strict=True)
        )
        return roofline(Cost(flops, moved), seconds, self.peaks) if seconds > 0 else None

    def load_fields(self) -> dict[str, float]:
        """The heartbeat's (``WorkerLoad``) roofline fields: totals per phase and the peaks."""
        fields = {
            f"{phase}_{name}": value
            for phase, totals in self.totals.items()
            for name, value in zip(("flops", "bytes", "busy_seconds"), totals, strict=True)
        }
        if self.peaks is not None:
            fields["peak_flops_per_second"] = self.peaks.flops_per_s
            fields["peak_bytes_per_second"] = self.peaks.bytes_per_s
        return fields


# -- the gateway's re-export ---------------------------------------------------------------------

# WorkerLoad's totals field suffix -> (the gateway's counter name, its help)
LOAD_COUNTERS = (
    ("flops", "pdserve_step_flops", "Forward-pass FLOPs per worker and phase (analytic)."),
    ("bytes", "pdserve_step_bytes", "Forward-pass bytes moved per worker and phase (analytic)."),
    ("busy_seconds", "pdserve_step_busy_seconds", "Forward-pass seconds per worker and phase."),
)
LOAD_GAUGES = (
    (
        "peak_flops_per_second",
        "pdserve_peak_flops_per_second",
        "Measured peak GEMM FLOP/s of each worker's device.",
    ),
    (
        "peak_bytes_per_second",
        "pdserve_peak_bytes_per_second",
        "Measured peak memory-read bandwidth of each worker's device.",
    ),
)


def roofline_families(loads: Iterable[Any]) -> list[CounterMetricFamily | GaugeMetricFamily]:
    """The workers' roofline totals and peaks, from their ``WorkerLoad`` heartbeats: counters
    labelled worker, role and phase, peak gauges worker and role (workers that have not
    measured their peaks report none)."""
    counters = [
        (field, CounterMetricFamily(name, doc, labels=["worker", "role", "phase"]))
        for field, name, doc in LOAD_COUNTERS
    ]
    gauges = [
        (field, GaugeMetricFamily(name, doc, labels=["worker", "role"]))
        for field, name, doc in LOAD_GAUGES
    ]
    for load in loads:
        for field, family in counters:
            for phase in PHASES:
                family.add_metric(
                    [load.worker_id, load.role, phase], getattr(load, f"{phase}_{field}")
                )
        for field, family in gauges:
            if getattr(load, field):  # 0: not measured
                family.add_metric([load.worker_id, load.role], getattr(load, field))
    return [family for _, family in counters + gauges if family.samples]
