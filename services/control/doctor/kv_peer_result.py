"""One size and block pattern of the two-process KV transfer test (``pdserve.services.control.doctor.kv_peer``):
the pull's and the raw send's times, and what they come to."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CaseResult:
    size_mib: float
    pattern: str
    num_blocks: int
    num_bytes: int
    messages: int
    pull_seconds: list[float] = field(default_factory=list)
    raw_seconds: list[float] = field(default_factory=list)

    @property
    def pull_median(self) -> float:
        return statistics.median(self.pull_seconds)

    @property
    def raw_median(self) -> float:
        return statistics.median(self.raw_seconds)

    @property
    def pull_gbps(self) -> float:
        return self.num_bytes / self.pull_median / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.num_bytes / self.raw_median / 1e9

    @property
    def ratio(self) -> float:
        """Pull throughput as a fraction of raw UCX's (1.0: the pull costs nothing extra)."""
        return self.raw_median / self.pull_median

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "pull_median_s": self.pull_median,
            "raw_median_s": self.raw_median,
            "pull_gbps": self.pull_gbps,
            "raw_gbps": self.raw_gbps,
            "ratio": self.ratio,
        }
