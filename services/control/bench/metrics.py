"""Benchmark metrics, defined as `vllm bench serve` defines them so results compare directly.

Per successful request (times in seconds):
- TTFT: first chunk with choices - send time.
- TPOT: (E2E - TTFT) / (output_tokens - 1), only for requests with more than one output token.
- ITL: every gap between consecutive chunks, pooled over all requests.
- E2E: last chunk with choices - send time.
Throughputs divide by the wall time of the whole run (first send to last completion).

Goodput (DistServe): a request is good when it succeeded and meets every SLO given
(TTFT <= ttft SLO, TPOT <= tpot SLO, E2E <= e2el SLO); a single-token request counts TPOT 0.
`request_goodput` is good requests per second, as vLLM reports it; `slo_attainment` is good
requests over all requests sent (failures count against it), as DistServe plots it; the
DistServe "goodput" of a system is the highest request rate whose attainment stays at or above
a target (90%), see `max_goodput_rate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pdserve.services.control.bench.client import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` (also comma separated) -> {"ttft": 200.0, "tpot": 50.0} in ms."""
    slos: dict[str, float] = {}
    for item in items or ():
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad goodput SLO {part!r}: use KEY:MS with KEY in {SLO_KEYS}")
            ms = float(value)
            if not ms >= 0:  # also rejects NaN
                raise ValueError(f"goodput SLO {key} must be a non-negative number of ms")
            slos[key] = ms
    return slos


@dataclass
class Distribution:
    """Summary of one latency metric in milliseconds."""

    count: int
    mean: float
    std: float
    median: float
    percentiles: dict[str, float]  # "p90" -> value

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        if len(seconds) == 0:
            # vLLM reports zeros rather than NaN when nothing was measured; keep that.
            return cls(0, 0.0, 0.0, 0.0, {_pname(p): 0.0 for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(
            count=int(ms.size),
            mean=float(ms.mean()),
            std=float(ms.std()),
            median=float(np.median(ms)),
            percentiles={_pname(p): float(np.percentile(ms, p)) for p in percentiles},
        )

    def p(self, pct: float) -> float:
        return self.percentiles[_pname(pct)]


def _pname(p: float) -> str:
    return f"p{p:g}"


@dataclass
class BenchMetrics:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    max_output_tokens_per_s: float  # busiest one-second bucket
    max_concurrent_requests: int  # most requests in flight in any one-second bucket
    output_len_mismatches: int  # succeeded but produced != max_tokens (server ignored ignore_eos?)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int = 0
    request_goodput: float = 0.0  # good requests / s
    slo_attainment: float = 0.0  # good requests / all requests
    # CPU seconds the client itself used per second of run: near 1 it is one busy core, and
    # its own event loop, not the server, may be setting the latencies
    client_cpu_fraction: float = 0.0
    # speculative decoding during the run, from the server's /metrics (0: none exposed)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the server's forward passes during the run by phase, against its workers' measured peaks
    # (bottleneck.py's PhaseBottleneck as a dict; empty: none exposed)
    bottleneck: dict[str, dict] = field(default_factory=dict)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / draft tokens (vLLM's draft acceptance rate), or None without drafts."""
        return (
            self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None
        )

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens a verified draft emits on average: 1 + accepted / drafts (vLLM's)."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BenchMetrics:
        """Inverse of to_dict (after a JSON round trip)."""
        values = dict(d)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            values[key] = Distribution(**d[key])
        return cls(**values)

    def vllm_flat(self) -> dict[str, float | int | None]:
        """The same numbers under the key names of `vllm bench serve`'s result JSON, so its
        tooling and dashboards read our files unchanged."""
        flat: dict[str, float | int | None] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput if self.goodput_slos_ms else None,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for key in ("ttft", "tpot", "itl", "e2el"):
            d: Distribution = getattr(self, f"{key}_ms")
            flat[f"mean_{key}_ms"] = d.mean
            flat[f"median_{key}_ms"] = d.median
            flat[f"std_{key}_ms"] = d.std
            for name, value in d.percentiles.items():
                flat[f"{name}_{key}_ms"] = value  # "p99" -> p99_ttft_ms, "p99.9" -> p99.9_ttft_ms
        return flat


def request_tpot(rec: RequestRecord) -> float | None:
    """Per-request time per output token after the first; None when there is no second token."""
    n = rec.output_tokens
    if not rec.success or n <= 1:
        return None
    return (rec.latency - rec.ttft) / (n - 1)


def is_good(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not rec.success:
        return False
    values = {
        "ttft": rec.ttft,
        "tpot": request_tpot(rec) or 0.0,  # a one-token answer has no decode phase to miss
        "e2el": rec.latency,
    }
    return all(values[k] <= slo / 1000.0 for k, slo in slos_ms.items())


def _peak_per_second(ok: list[RequestRecord]) -> tuple[float, int]:
    """Busiest one-second bucket of output tokens, and of requests in flight."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t1 = max(r.start_time + r.latency for r in ok)
    buckets = int(math.ceil(t1 - t0)) + 1
    tokens = np.zeros(buckets)
    inflight = np.zeros(buckets, dtype=np.int64)
    for r in ok:
        # one timestamp per chunk: the first at TTFT, the rest after each ITL gap
        times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(tokens, np.clip((times - t0).astype(np.int64), 0, buckets - 1), 1)
        first, last = int(r.start_time - t0), int(r.start_time + r.latency - t0)
        inflight[first : last + 1] += 1
    return float(tokens.max()), int(inflight.max())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchMetrics:
    if duration_s <= 0:
        raise ValueError("run duration must be positive")
    slos = dict(goodput_slos_ms or {})
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [t for r in ok if (t := request_tpot(r)) is not None]
    itls = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    peak_tokens, peak_inflight = _peak_per_second(ok)
    good = sum(is_good(r, slos) for r in records) if slos else 0
    return BenchMetrics(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=Distribution.of(ttfts, percentiles),
        tpot_ms=Distribution.of(tpots, percentiles),
        itl_ms=Distribution.of(itls, percentiles),
        e2el_ms=Distribution.of(e2els, percentiles),
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_inflight,
        output_len_mismatches=sum(r.output_tokens != r.expected_output_len for r in ok),
        goodput_slos_ms=slos,
        good_requests=good,
        request_goodput=good / duration_s if slos else 0.0,
        slo_attainment=good / len(records) if slos and records else 0.0,
    )


def max_goodput_rate(
    points: Sequence[tuple[float, float]], target_attainment: float = 0.9
) -> float | None:
    """DistServe goodput of a sweep: the highest offered request rate whose SLO attainment is
    at or above the target, from (rate, attainment) points; None if no point makes it.

    Only tested rates are returned (no interpolation), so the answer is a lower bound that a
    finer sweep can only raise.
    """
    passing = [rate for rate, att in points if att >= target_attainment and math.isfinite(rate)]
    return max(passing) if passing else None
