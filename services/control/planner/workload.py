"""The request stream a deployment must serve, and the latency it promises.

``Workload``: a request rate and prompt/output lengths (ISL/OSL), as means and optionally as
(ISL, OSL) samples, kept in pairs because long prompts and long answers are often correlated. The
samples can come from a ``pdserve bench`` run: its ``<name>.records.jsonl`` has one JSON object
per request (``prompt_len``, ``output_tokens``, ``success``, ``start_time`` in seconds from the
run's start, ``run``, ``series``, ``request_rate``; see services/control/bench/results.py ``record_lines``).

``SLO``: TTFT and ITL targets in ms, met at a percentile (p50 or p99): "p99" means 99% of
requests must see a TTFT and a mean inter-token latency within the targets. That per-request
reading is what attainment counts (services/control/bench/metrics.py's goodput does the same with TPOT).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PERCENTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    itl_ms: float
    percentile: str = "p99"

    def __post_init__(self) -> None:
        if self.percentile not in PERCENTILES:
            raise ValueError(f"percentile must be one of {sorted(PERCENTILES)}")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("SLO targets must be positive")

    @property
    def quantile(self) -> float:
        """0.5 for p50, 0.99 for p99: also the share of requests that must meet the SLO."""
        return PERCENTILES[self.percentile]

    def met_by(self, ttft_ms: float, itl_ms: float) -> bool:
        return ttft_ms <= self.ttft_ms and itl_ms <= self.itl_ms

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms and ITL <= {self.itl_ms:g} ms at {self.percentile}"


@dataclass(frozen=True)
class Workload:
    request_rate: float  # requests/s
    isl: float  # mean prompt length, tokens
    osl: float  # mean output length, tokens
    samples: tuple[tuple[int, int], ...] = ()  # (isl, osl) pairs; empty = every request at the mean

    def __post_init__(self) -> None:
        if self.request_rate < 0 or self.isl < 1 or self.osl < 1:
            raise ValueError("a workload needs rate >= 0, ISL >= 1 and OSL >= 1")

    @classmethod
    def from_samples(cls, request_rate: float, samples: Sequence[tuple[int, int]]) -> Workload:
        """Means taken from the samples themselves."""
        if not samples:
            raise ValueError("no samples")
        pairs = tuple((max(1, int(i)), max(1, int(o))) for i, o in samples)
        isl = sum(i for i, _ in pairs) / len(pairs)
        osl = sum(o for _, o in pairs) / len(pairs)
        return cls(request_rate, isl, osl, pairs)

    def lengths(self, rng: random.Random) -> tuple[int, int]:
        """One request's (ISL, OSL): a sample drawn with replacement, or the rounded means."""
        if self.samples:
            return self.samples[rng.randrange(len(self.samples))]
        return max(1, round(self.isl)), max(1, round(self.osl))

    def at_rate(self, request_rate: float) -> Workload:
        return Workload(request_rate=request_rate, isl=self.isl, osl=self.osl, samples=self.samples)

    @property
    def decode_context(self) -> float:
        """A decoding sequence's mean context: the prompt plus half the answer so far."""
        return self.isl + self.osl / 2

    def describe(self) -> str:
        shape = f"{len(self.samples)} samples" if self.samples else "fixed lengths"
        return (
            f"{self.request_rate:g} req/s, ISL {self.isl:.0f}, OSL {self.osl:.0f} (mean, {shape})"
        )

    @classmethod
    def from_bench_records(
        cls,
        path: Path | str,
        *,
        run: int | None = None,
        request_rate: float | None = None,
    ) -> Workload:
        """A workload from a ``pdserve bench`` result: its ``.records.jsonl``, or the ``.json``
        beside which that file lies. Failed requests are left out (their lengths say nothing of
        what was served). ``run`` picks one run of a sweep (default: all). The rate is the run's
        own (requests over the span of their start times) unless ``request_rate`` is given."""
        path = Path(path)
        if path.suffix == ".json":
            path = path.with_suffix(".records.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("success") and (run is None or r.get("run") == run)]
        if not rows:
            raise ValueError(f"{path}: no successful request records")
        pairs = [(int(r["prompt_len"]), _output_len(r)) for r in rows]
        if request_rate is None:
            request_rate = _observed_rate(rows)
        return cls.from_samples(request_rate, pairs)


def _output_len(row: dict[str, Any]) -> int:
    """What the server generated; a record from before usage counting has the requested length."""
    out = row.get("output_tokens")
    return int(out) if out else int(row["expected_output_len"])


def _observed_rate(rows: list[dict[str, Any]]) -> float:
    """Requests per second over the span of the start times; one run at a time: a sweep's runs
    each start at 0, so their spans overlap and the rate is per run, averaged."""
    by_run: dict[Any, list[float]] = {}
    for r in rows:
        by_run.setdefault(r.get("run"), []).append(float(r["start_time"]))
    rates = []
    for starts in by_run.values():
        span = max(starts) - min(starts)
        if len(starts) > 1 and span > 0:
            # n starts span n - 1 gaps
            rates.append((len(starts) - 1) / span)
    if not rates:
        raise ValueError("the records do not span any time: give request_rate")
    return sum(rates) / len(rates)
