"""The closed-form arithmetic: how many workers of each role a load needs, with the working shown.

Prefill (after Dynamo's SLA planner, with a queueing model of ours)::

    load_P = rate x ISL x min(1, c_P) / throughput(ISL)       (in busy workers, "Erlangs")
    P      = the fewest workers whose TTFT percentile meets the SLO at that load

- ``throughput(ISL)`` is the profiled tokens/s of one prefill worker at the mean prompt length;
- ``c_P`` = observed TTFT / expected TTFT, expected being the profiled time of one mean prompt on
  an idle worker. Queueing always makes the observed TTFT larger, so only ``min(1, c_P)`` is used
  (as Dynamo does): the correction can only credit a prefill that runs faster than profiled
  (prefix-cache hits, a faster build), while queueing is the queueing model's business;
- Dynamo stops at ceil(load_P), i.e. sizes prefill to 100% utilization, where the queue (and
  TTFT) grows without bound. We size the pool as the M/G/N queue it is (Poisson arrivals, the
  gateway sends each prompt to the least-loaded worker, service time S = ISL / throughput with
  squared coefficient of variation ``cv2``): an arrival waits with the Erlang-C probability C, and
  a wait is then roughly exponential with mean S (1 + cv2) / (2 N (1 - rho)) (Allen-Cunneen), so
  ``TTFT_q = S + S (1 + cv2) / (2 N (1 - rho)) x ln(C / (1 - q))`` once C > 1 - q, else S.
  Utilization stays within [RHO_FLOOR, RHO_CAP]: a TTFT no pool could meet is not bought with a
  fleet ten times the load (the sizing says the SLO is at risk instead).

Decode (Dynamo's)::

    need_D = rate x OSL / tokens_per_s(b*),   b* = the largest batch with ITL(b*, ctx) <= ITL_SLO / c_D

- ``ctx`` = ISL + OSL / 2, a running sequence's mean context;
- ``c_D`` = observed ITL / profiled ITL at the observed batch: an engine slower than profiled makes
  the ITL target tighter, so the batch smaller and the worker count larger;
- the batch must also fit ``kv_fraction`` of the KV pool (the saturation mark of decide, so a
  fleet sized here is not "saturated" by the rule that guards scale-down).

Workers = ceil(need), computed without float noise (2.0000000001 is 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from pdserve.services.control.planner.profile import DecodeCapacity, Profile
from pdserve.services.control.planner.workload import SLO

RHO_CAP = 0.95  # never plan a queue closer to saturation than this
RHO_FLOOR = 0.10  # nor buy a TTFT with more than 10x the bare load: say the SLO is at risk


def ceil_workers(need: float) -> int:
    return math.ceil(round(need, 9))


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in an M/M/N queue with ``offered`` Erlangs (Erlang
    B's stable recursion, then C from B)."""
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


def ttft_quantile(
    service_s: float, offered: float, servers: int, quantile: float, cv2: float = 1.0
) -> float:
    """The TTFT q-quantile (s) of a prefill pool of ``servers`` at ``offered`` Erlangs."""
    if servers <= 0 or offered >= servers:
        return math.inf
    waits = erlang_c(servers, offered)
    if waits <= 1.0 - quantile:
        return service_s
    tail_rate = 2 * (servers - offered) / ((1 + cv2) * service_s)  # 1 / mean wait of the waiters
    return service_s + math.log(waits / (1.0 - quantile)) / tail_rate


@lru_cache(maxsize=4096)
def pool_capacity(
    workers: int, service_s: float, ttft_s: float, quantile: float, cv2: float = 1.0
) -> float:
    """The most load (Erlangs) ``workers`` prefill workers carry with the TTFT quantile within
    ``ttft_s``, between RHO_FLOOR and RHO_CAP utilization (bisection: TTFT grows with load)."""
    if workers <= 0:
        return 0.0
    hi = workers * RHO_CAP
    if ttft_quantile(service_s, hi, workers, quantile, cv2) <= ttft_s:
        return hi
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi)
            if ttft_quantile(service_s, mid, workers, quantile, cv2) <= ttft_s
            else (lo, mid)
        )
    return max(workers * RHO_FLOOR, lo)


def prefill_pool(
    service_s: float, offered: float, ttft_s: float, quantile: float, cv2: float = 1.0
) -> tuple[float, int]:
    """The fewest workers whose capacity holds the load, and the load as fractional workers: n - 1
    plus how far it lies between the capacities of n - 1 and n workers (so ceil of it is n)."""
    if offered <= 0:
        return 0.0, 0
    n = max(1, math.ceil(offered / RHO_CAP - 1e-9))
    while pool_capacity(n, service_s, ttft_s, quantile, cv2) < offered:
        n += 1
    below = pool_capacity(n - 1, service_s, ttft_s, quantile, cv2)
    top = pool_capacity(n, service_s, ttft_s, quantile, cv2)
    return n - 1 + max(1e-9, (offered - below) / (top - below)), n


@dataclass(frozen=True)
class PrefillSizing:
    offered: float  # busy workers the demand makes: rate x ISL x min(1, c) / throughput
    per_worker_tokens_per_s: float  # profiled, at the mean ISL
    service_ms: float  # one mean prompt on an idle worker
    ttft_target_s: float
    quantile: float
    cv2: float
    correction: float  # c_P as given (min(1, c) is what was applied)

    def workers_at(self, scale: float = 1.0) -> int:
        """The pool for ``scale`` times this load (decide's dead band asks with scale > 1)."""
        return prefill_pool(self._service_s, self.offered * scale, *self._target)[1]

    @property
    def _service_s(self) -> float:
        return self.service_ms / 1e3

    @property
    def _target(self) -> tuple[float, float, float]:
        return self.ttft_target_s, self.quantile, self.cv2

    @property
    def workers(self) -> int:
        return self.workers_at(1.0)

    @property
    def need(self) -> float:
        """Fractional workers (reports, the budget's split); ceil(need) == workers."""
        return prefill_pool(self._service_s, self.offered, *self._target)[0]

    @property
    def at_risk(self) -> bool:
        """The TTFT SLO is not met even by the pool sized at RHO_FLOOR utilization."""
        n = self.workers
        ttft = ttft_quantile(self._service_s, self.offered, n, *self._target[1:])
        return n > 0 and ttft > self.ttft_target_s

    def explain(self) -> str:
        n = self.workers
        ttft = ttft_quantile(self._service_s, self.offered, n, *self._target[1:])
        risk = " (TTFT SLO at risk: not met even at low utilization)" if self.at_risk else ""
        return (
            f"prefill: load {self.offered / max(min(1.0, self.correction), 1e-12):.2f} busy workers"
            f" (rate x ISL / {self.per_worker_tokens_per_s:,.0f} tok/s per worker; a prompt"
            f" {self.service_ms:.1f} ms) x min(1, c={self.correction:.2f}) = {self.offered:.2f};"
            f" {n} worker(s) at utilization {self.offered / max(n, 1):.2f} give TTFT"
            f" p{self.quantile * 100:g} ~ {ttft * 1e3:.0f} ms (target"
            f" {self.ttft_target_s * 1e3:g}) -> {n}{risk}"
        )


@dataclass(frozen=True)
class DecodeSizing:
    need: float
    demand_tokens_per_s: float  # rate x OSL
    capacity: DecodeCapacity  # b*, its ITL and tokens/s
    itl_target_ms: float  # ITL_SLO / c_D
    context: float
    correction: float

    def workers_at(self, scale: float = 1.0) -> int:
        return ceil_workers(self.need * scale)

    @property
    def workers(self) -> int:
        return ceil_workers(self.need)

    def explain(self) -> str:
        cap = self.capacity
        return (
            f"decode: demand {self.demand_tokens_per_s:,.0f} tok/s; ITL target"
            f" {self.itl_target_ms:.1f} ms (SLO / c={self.correction:.2f}) at context"
            f" {self.context:.0f}: batch {cap.batch} ({cap.limited_by}) at {cap.itl_ms:.1f} ms ="
            f" {cap.tokens_per_s:,.0f} tok/s per worker -> need {self.need:.2f} -> {self.workers}"
        )


def size_prefill(
    profile: Profile,
    rate: float,
    isl: float,
    slo: SLO,
    correction: float = 1.0,
    cv2: float = 1.0,
) -> PrefillSizing:
    per_worker = profile.prefill_throughput(isl)
    return PrefillSizing(
        offered=rate * isl * min(1.0, correction) / per_worker,
        per_worker_tokens_per_s=per_worker,
        service_ms=isl / per_worker * 1e3,
        ttft_target_s=slo.ttft_ms / 1e3,
        quantile=slo.quantile,
        cv2=cv2,
        correction=correction,
    )


@lru_cache(maxsize=4096)
def _best_decode(
    profile: Profile, itl_target_ms: float, context: float, kv_fraction: float
) -> DecodeCapacity:
    """``Profile.best_decode``, remembered: a decision sizes decode for several outlooks of one
    load (the same target, contexts a token apart), and the scan is over every batch."""
    return profile.best_decode(itl_target_ms, context, kv_fraction)


def size_decode(
    profile: Profile,
    rate: float,
    isl: float,
    osl: float,
    slo: SLO,
    correction: float = 1.0,
    kv_fraction: float = 0.8,
) -> DecodeSizing:
    context = isl + osl / 2
    target = slo.itl_ms / correction
    capacity = _best_decode(profile, target, context, kv_fraction)
    demand = rate * osl
    return DecodeSizing(
        need=demand / capacity.tokens_per_s,
        demand_tokens_per_s=demand,
        capacity=capacity,
        itl_target_ms=target,
        context=context,
        correction=correction,
    )


def prefill_correction(profile: Profile, observed_ttft_ms: float, isl: float) -> float:
    """Observed TTFT over the profiled time of one mean prompt on an idle worker."""
    return observed_ttft_ms / (1000.0 * profile.prefill_seconds(isl))


def decode_correction(
    profile: Profile, observed_itl_ms: float, batch: float, context: float
) -> float:
    """Observed ITL over the profiled ITL at the batch the workers actually ran."""
    return observed_itl_ms / profile.decode_itl(max(1.0, batch), context)
