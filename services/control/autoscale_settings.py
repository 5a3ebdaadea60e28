"""``pdserve up --autoscale``'s flags turned into the planner's inputs, refused in one line
before anything starts: the SLOs and profile (``settings``), and each role's limits within the
budget (``fleet_limits``). services/control/autoscale.py runs the planner with them."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.control.planner.inputs import ROLES, Counts, Limits, PlannerConfig
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.workload import SLO
from pdserve.shared.config import UpConfig
from pdserve.shared.errors import StartupError


@dataclass(frozen=True)
class Settings:
    profile: Profile
    slo: SLO
    interval_s: float
    warmup_s: float
    metrics_port: int


def settings(up: UpConfig) -> Settings:
    """The planner's inputs from the flags, refused in one line before anything starts. Clamps
    the starting counts (--prefill/--decode-workers) into each role's [min, max]."""
    if not up.planner_profile:
        raise StartupError(
            "--autoscale needs --planner-profile FILE: what one prefill and one decode worker of "
            "this model do on this host. `pdserve plan --model M --profile-out FILE` (with a "
            "workload, the SLOs and the engine options you give pdserve up) measures it"
        )
    try:
        profile = Profile.load(up.planner_profile)
        slo = SLO(up.slo_ttft_ms, up.slo_itl_ms, up.slo_percentile)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StartupError(f"--planner-profile {up.planner_profile}: {exc}") from None
    if up.autoscale_interval <= 0 or up.planner_warmup_seconds < 0:
        raise StartupError("--autoscale-interval must be > 0 and --planner-warmup-seconds >= 0")
    if up.autoscale_max_cpus and up.autoscale_max_gpus:
        raise StartupError("give one budget: --autoscale-max-cpus or --autoscale-max-gpus")
    if up.prefill_workers == 0:
        raise StartupError("--autoscale sizes prefill and decode apart: not --prefill-workers 0")
    for role in ROLES:
        low, high = getattr(up, f"min_{role}_workers"), getattr(up, f"max_{role}_workers")
        if low < 1 or (high and high < low):
            raise StartupError(
                f"--autoscale needs 1 <= --min-{role}-workers <= --max-{role}-workers"
            )
        start = getattr(up, f"{role}_workers")
        setattr(up, f"{role}_workers", max(low, min(high or start, start)))
    return Settings(
        profile=profile,
        slo=slo,
        interval_s=up.autoscale_interval,
        warmup_s=up.planner_warmup_seconds,
        metrics_port=up.planner_metrics_port,
    )


def fleet_limits(up: UpConfig, costs: dict[str, float], budget: float, unit: str) -> Limits:
    """Each role's [min, max] and cost within the budget; a max of 0 is what the budget holds
    beside the other role's minimum."""
    bounds = {}
    for role in ROLES:
        other = "decode" if role == "prefill" else "prefill"
        low, high = getattr(up, f"min_{role}_workers"), getattr(up, f"max_{role}_workers")
        room = budget - getattr(up, f"min_{other}_workers") * costs[other]
        bounds[role] = (low, high or max(low, int(room / costs[role] + 1e-9)))
    try:
        return Limits(
            min_prefill=bounds["prefill"][0],
            max_prefill=bounds["prefill"][1],
            min_decode=bounds["decode"][0],
            max_decode=bounds["decode"][1],
            prefill_cost=costs["prefill"],
            decode_cost=costs["decode"],
            budget=budget,
            unit=unit,
        )
    except ValueError as exc:
        flag = f"--autoscale-max-{unit.lower()}s"
        raise StartupError(f"--autoscale: {exc}; {flag} raises it (workers then share)") from None


def planner_options(
    settings: Settings, pool_floor: Counts, unit: str, budget: float, cpus: int
) -> PlannerConfig:
    """The planner's options. Where the budget oversubscribes a CPU host, busy workers split its
    cores, and the planner fits its counts to them (guards.fit_cores)."""
    shared = unit == "CPU" and budget > cpus
    return PlannerConfig(
        warmup_s=settings.warmup_s,
        pool_floor=pool_floor,
        host_cpus=float(cpus) if shared else None,
    )
