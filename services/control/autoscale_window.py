"""What ``pdserve up --autoscale`` reads from the gateway's /metrics, and the planner's window
built from two readings of it.

A ``Snapshot`` is one scrape: the cumulative TTFT and ITL histogram buckets, the request and
token counters, and each worker's load as the gateway re-exports it (KV blocks, running,
waiting, draining). A window is the difference of two snapshots over the time between them:

- TTFT and ITL at the SLO's percentile from the bucket deltas, interpolated inside the bucket
  the way Prometheus' ``histogram_quantile`` does (a percentile over the whole run would carry
  yesterday's load into today's decision);
- the request rate from the finished-request counter's delta (every finish reason: an error or
  an abort was demand too), mean ISL and OSL from the token counters' deltas per request;
- each worker's load from the newer snapshot (gauges are a "now", not a window).

The workers are the ones the launcher runs, not the ones the gateway lists: a worker still
loading its model is capacity that is coming (counting it stops the planner from asking again
every window), and its age keeps the planner's warm-up rule honest; a worker being drained, or
one the gateway reports draining, is no capacity at all and is left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.control.planner.inputs import MetricsWindow, WorkerSample

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
REQUESTS = "pdserve_requests"  # finished requests
IN_FLIGHT = "pdserve_requests_in_flight"
PROMPT_TOKENS = "pdserve_prompt_tokens"
GENERATION_TOKENS = "pdserve_generation_tokens"
# the gateway's re-export of each worker's heartbeat (shared/telemetry/metrics.WorkerLoadCollector)
WORKER_GAUGES = {
    "pdserve_kv_cache_used_blocks": "kv_used",
    "pdserve_kv_cache_total_blocks": "kv_total",
    "pdserve_running_requests": "running",
    "pdserve_waiting_requests": "waiting",
    "pdserve_worker_draining": "draining",
}

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), increasing bounds


@dataclass(frozen=True)
class WorkerGauges:
    role: str
    kv_used: float = 0.0
    kv_total: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    draining: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total > 0 else 0.0


@dataclass(frozen=True)
class Snapshot:
    ttft: Buckets = ()
    itl: Buckets = ()
    requests: float = 0.0  # finished
    in_flight: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    workers: dict[str, WorkerGauges] = field(default_factory=dict)


def parse_snapshot(text: str) -> Snapshot:
    """One scrape of the gateway's /metrics (Prometheus text format)."""
    hist: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    totals = {REQUESTS: 0.0, PROMPT_TOKENS: 0.0, GENERATION_TOKENS: 0.0}
    gauges: dict[str, dict[str, float]] = {}
    roles: dict[str, str] = {}
    in_flight = 0.0
    # by sample name: the parser files a counter's samples under a family named with or
    # without ``_total`` depending on how the TYPE line spells it
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith("_bucket") and name[: -len("_bucket")] in hist:
                hist[name[: -len("_bucket")]][float(sample.labels["le"])] = sample.value
            elif name.endswith("_total") and name[: -len("_total")] in totals:
                totals[name[: -len("_total")]] += sample.value
            elif name == IN_FLIGHT:
                in_flight += sample.value
            elif name in WORKER_GAUGES and "worker" in sample.labels:
                worker = sample.labels["worker"]
                roles[worker] = sample.labels.get("role", "")
                gauges.setdefault(worker, {})[WORKER_GAUGES[name]] = sample.value
    return Snapshot(
        ttft=tuple(sorted(hist[TTFT].items())),
        itl=tuple(sorted(hist[ITL].items())),
        requests=totals[REQUESTS],
        in_flight=in_flight,
        prompt_tokens=totals[PROMPT_TOKENS],
        generation_tokens=totals[GENERATION_TOKENS],
        workers={w: WorkerGauges(roles[w], **values) for w, values in gauges.items()},
    )


def bucket_quantile(before: Buckets, after: Buckets, q: float) -> float | None:
    """The q-quantile of the observations made between two readings of one histogram, or None
    without any. Linear inside the bucket it falls in (from the bucket below's bound, 0 for the
    first); in the +Inf bucket, the largest finite bound (nothing better is known)."""
    old = dict(before)
    deltas = [(le, max(0.0, count - old.get(le, 0.0))) for le, count in after]
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in deltas:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_bound
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


@dataclass(frozen=True)
class Worker:
    """A worker as the launcher knows it: its role, how long ago it registered, and whether it
    is still loading (started, not registered yet)."""

    role: str
    age_s: float
    loading: bool = False


def build_window(
    before: Snapshot,
    after: Snapshot,
    duration_s: float,
    quantile: float,
    workers: Mapping[str, Worker],
) -> MetricsWindow:
    """The planner's window between two snapshots ``duration_s`` apart. ``workers``: the workers
    that count as capacity (id -> role and age), draining ones already left out by the caller;
    one the gateway reports draining is left out here too."""
    # arrivals, not completions: a backlog finishes in bursts, and a window of no completions
    # read as "no demand" (the gateway counts requests when they finish)
    finished = max(0.0, after.requests - before.requests)
    requests = max(0.0, finished + after.in_flight - before.in_flight)
    prompt = max(0.0, after.prompt_tokens - before.prompt_tokens)
    generated = max(0.0, after.generation_tokens - before.generation_tokens)
    ttft = bucket_quantile(before.ttft, after.ttft, quantile)
    itl = bucket_quantile(before.itl, after.itl, quantile)
    samples = []
    for worker_id, worker in sorted(workers.items()):
        load = after.workers.get(worker_id, WorkerGauges(worker.role))  # not registered yet
        if load.draining:
            continue
        samples.append(
            WorkerSample(
                worker_id=worker_id,
                role=worker.role,
                age_s=worker.age_s,
                kv_usage=load.kv_usage,
                queue=round(load.waiting),
                running=round(load.running),
                loading=worker.loading,
            )
        )
    return MetricsWindow(
        duration_s=duration_s,
        requests=round(requests),
        mean_isl=prompt / finished if finished else 0.0,  # token counts come at the finish
        mean_osl=generated / finished if finished else 0.0,
        ttft_ms=None if ttft is None else ttft * 1e3,
        itl_ms=None if itl is None else itl * 1e3,
        workers=tuple(samples),
    )
