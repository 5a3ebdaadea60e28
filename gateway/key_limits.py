"""Limits per API key on generation requests: how many one key has in flight
(``--max-concurrent-requests-per-key``) and how many tokens it used in the last minute
(``--tokens-per-minute-per-key``), each 0 for none; and the per-key metrics, which count
whether limits are set or not.

Accounting: a sliding window of 60 s. A request's prompt tokens are charged when it is admitted
and its completion tokens as they arrive from the workers (a long stream pays as it goes). A request is admitted while the key's tokens in the window are below the budget, so one
request may carry a key past it; the key then waits until enough of its charges leave the
window (the 429's ``Retry-After`` says when the first admission can succeed). Requests that
presented no key - none is configured - share one bucket, ``anonymous``: the limits then act on
the gateway as a whole.

Keys are known by their id (``gateway/access.py:key_id``), never by themselves, here and in
the metrics (``pdserve_key_*{key_id}``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.gateway.errors import rate_limited

WINDOW = 60.0  # seconds of the token budget
MERGE = 1.0  # charges this close together are kept as one (a key holds ~60 entries at most)


@dataclass
class _Usage:
    in_flight: int = 0
    charges: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens), oldest first
    in_window: int = 0  # the sum of ``charges``


class KeyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdserve_key_requests",
            "generation requests admitted, by API key id",
            ["key_id"],
            registry=registry,
        )
        self.rejected = Counter(
            "pdserve_key_rejected",
            "generation requests refused with 429, by API key id and limit (concurrency, tokens)",
            ["key_id", "reason"],
            registry=registry,
        )
        self.tokens = Counter(
            "pdserve_key_tokens",
            "tokens charged to an API key, by kind (prompt, completion)",
            ["key_id", "kind"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "pdserve_key_in_flight",
            "generation requests in flight, by API key id",
            ["key_id"],
            registry=registry,
        )


class Ticket:
    """One admitted request's account: ``charge`` its completion tokens as they come."""

    def __init__(self, limits: KeyLimits, key_id: str) -> None:
        self._limits = limits
        self.key_id = key_id

    def charge(self, completion_tokens: int) -> None:
        self._limits.charge(self.key_id, completion_tokens, "completion")


class KeyLimits:
    def __init__(
        self,
        max_concurrent: int,
        tokens_per_minute: int,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self.metrics = KeyMetrics(registry)
        self._clock = clock
        # one entry per key id: bounded by the configured keys (and "anonymous")
        self._usage: dict[str, _Usage] = {}

    @contextlib.contextmanager
    def admit(self, key_id: str, prompt_tokens: int) -> Iterator[Ticket]:
        """Hold a place for one request of ``key_id``, its prompt charged, or refuse it (429
        with ``Retry-After``)."""
        usage = self._usage.setdefault(key_id, _Usage())
        now = self._clock()
        self._expire(usage, now)
        if self.max_concurrent and usage.in_flight >= self.max_concurrent:
            self.metrics.rejected.labels(key_id, "concurrency").inc()
            raise rate_limited(
                f"this API key has {usage.in_flight} requests in flight, the most allowed "
                "(--max-concurrent-requests-per-key)",
                "requests",
                retry_after=1.0,
            )
        if self.tokens_per_minute and usage.in_window >= self.tokens_per_minute:
            self.metrics.rejected.labels(key_id, "tokens").inc()
            raise rate_limited(
                f"this API key used {usage.in_window} tokens in the last minute, its budget "
                f"is {self.tokens_per_minute} (--tokens-per-minute-per-key)",
                "tokens",
                retry_after=self._wait(usage, now),
            )
        usage.in_flight += 1
        self.metrics.requests.labels(key_id).inc()
        self.metrics.in_flight.labels(key_id).inc()
        self.charge(key_id, prompt_tokens, "prompt")
        try:
            yield Ticket(self, key_id)
        finally:
            usage.in_flight -= 1
            self.metrics.in_flight.labels(key_id).dec()

    def charge(self, key_id: str, tokens: int, kind: str) -> None:
        if tokens <= 0:
            return
        self.metrics.tokens.labels(key_id, kind).inc(tokens)
        if not self.tokens_per_minute:
            return  # nothing to keep: no budget to judge
        usage = self._usage.setdefault(key_id, _Usage())
        now = self._clock()
        if usage.charges and now - usage.charges[-1][0] < MERGE:
            # dated by the earlier charge: these tokens leave the window up to MERGE s early
            when, earlier = usage.charges[-1]
            usage.charges[-1] = (when, earlier + tokens)
        else:
            usage.charges.append((now, tokens))
        usage.in_window += tokens

    def used(self, key_id: str) -> int:
        """Tokens ``key_id`` used in the last minute."""
        usage = self._usage.get(key_id)
        if usage is None:
            return 0
        self._expire(usage, self._clock())
        return usage.in_window

    @staticmethod
    def _expire(usage: _Usage, now: float) -> None:
        while usage.charges and usage.charges[0][0] <= now - WINDOW:
            usage.in_window -= usage.charges.popleft()[1]

    def _wait(self, usage: _Usage, now: float) -> float:
        """Seconds until the key's tokens in the window fall below the budget."""
        excess = usage.in_window - self.tokens_per_minute + 1
        for when, tokens in usage.charges:
            excess -= tokens
            if excess <= 0:
                return max(0.0, when + WINDOW - now)
        return WINDOW
