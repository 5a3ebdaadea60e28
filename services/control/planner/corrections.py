"""The planner's corrections: how far the engine strays from its profile, learnt from each
window's latencies (observed TTFT over the profiled prefill time, observed ITL over the profiled
ITL at the batch the workers ran), unless the window's samples are suspect (too few, from a
worker still loading or warming up, or from a load that moved within the window). sizing.py says how each correction is applied."""

from __future__ import annotations

import dataclasses

from pdserve.services.control.planner.inputs import MetricsWindow, PlannerConfig, PlannerState
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.planner.rules import FEW_REQUESTS, UNSTEADY, WARMUP
from pdserve.services.control.planner.sizing import decode_correction, prefill_correction


def corrections(
    window: MetricsWindow, profile: Profile, state: PlannerState, config: PlannerConfig
) -> tuple[PlannerState, list[str], list[str]]:
    """Update the corrections from this window's latencies, unless its samples are suspect."""
    reasons: list[str] = []
    rules: list[str] = []
    lo, hi = config.correction_bounds
    updates: dict[str, float] = {}
    before, rate = state.rate.level, window.request_rate
    moved = abs(rate - before) / max(rate, before, 1e-9) if state.rate.n else 0.0
    for role, observed in (("prefill", window.ttft_ms), ("decode", window.itl_ms)):
        old = getattr(state, f"{role}_correction")
        young = [w for w in window.of(role) if w.loading or w.age_s < config.warmup_s]
        if window.requests < config.min_requests:
            rules.append(FEW_REQUESTS)
            reasons.append(
                f"{role} correction kept at {old:.2f}: {window.requests} requests <"
                f" {config.min_requests} [{FEW_REQUESTS}]"
            )
            continue
        if moved > config.steady_band:
            # the latencies came from the whole window, the batch the profile is read at from
            # its end: under a moving load they belong to different loads (an ITL of the peak
            # over the profile at the trough's batch read as a slow engine)
            rules.append(UNSTEADY)
            reasons.append(
                f"{role} correction kept at {old:.2f}: the rate moved {moved:.0%} from"
                f" {before:.2f} req/s (> {config.steady_band:.0%}) [{UNSTEADY}]"
            )
            continue
        if young:
            rules.append(WARMUP)
            reasons.append(
                f"{role} correction kept at {old:.2f}: {len(young)} {role} worker(s) loading or"
                f" younger than the {config.warmup_s:g} s warm-up [{WARMUP}]"
            )
            continue
        if observed is None or window.mean_isl <= 0:
            continue
        if role == "prefill":
            raw = prefill_correction(profile, observed, window.mean_isl)
            what = f"TTFT {observed:.1f} ms / profiled {profile.prefill_seconds(window.mean_isl) * 1e3:.1f} ms"
        else:
            workers = window.of("decode")
            # the batch a token sees (weighted by batch): a mean over workers would let an idle
            # new worker halve it while the busy one runs twice as full
            total = sum(w.running for w in workers)
            batch = sum(w.running**2 for w in workers) / total if total else 1.0
            context = window.mean_isl + window.mean_osl / 2
            raw = decode_correction(profile, observed, batch, context)
            what = (
                f"ITL {observed:.1f} ms / profiled {profile.decode_itl(max(1.0, batch), context):.1f}"
                f" ms at batch {batch:.0f}"
            )
        updates[f"{role}_correction"] = min(hi, max(lo, raw))
        reasons.append(f"{role} correction {updates[f'{role}_correction']:.2f} ({what})")
    return dataclasses.replace(state, **updates), reasons, rules
