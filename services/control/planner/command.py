"""``pdserve plan``: how many prefill and decode workers a workload needs under its SLOs, on this
machine, and whether one aggregated pool would do better.

    pdserve plan --request-rate 0.5 --isl 512 --osl 128 --ttft-ms 5000 --itl-ms 300
    pdserve plan --workload-records perf/results/chat.records.jsonl --ttft-ms 2000 --itl-ms 100 \
        --profile perf/results/plan-profile.json --max-gpus 8

1. The profile: short real runs of a prefill and a decode worker of ``--model`` with the engine
   options ``pdserve up`` takes (profile_run.py; about a minute for SmolLM2 on 2 CPUs, seconds
   with ``--quick``), saved to ``--profile-out``; or ``--profile FILE`` reuses a saved one.
2. The workload: ``--request-rate``, ``--isl``, ``--osl``, or the requests of a ``pdserve bench``
   records file (their lengths, and their rate unless ``--request-rate`` is given).
3. The budget: ``--max-cpus`` or ``--max-gpus`` (default: this host's), counted in what one worker
   of each role took while profiled (its CPU share, or its GPUs).
4. The advice (services/control/planner/advisor.py): the closed form, every P:D near it and aggregated pools
   simulated on the profile, the arithmetic printed, attainment against P:D plotted to ``--plot``.

Exit 0 with advice (also when nothing within the budget meets the SLO: the report says so);
2 with one line for unusable input.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.options import add_options, build, opt

PERCENTILE_CHOICES = ("p50", "p90", "p95", "p99")  # services/control/planner/workload.PERCENTILES


class PlanInputError(StartupError):
    """Input ``pdserve plan`` cannot use: the CLI prints it as one line and exits 2."""


@dataclass
class PlanConfig:
    request_rate: float | None = opt(
        None, "requests/s to serve (with --workload-records: default the records' own rate)"
    )
    isl: float | None = opt(None, "mean prompt length, tokens")
    osl: float | None = opt(None, "mean output length, tokens")
    workload_records: str | None = opt(
        None,
        "a pdserve bench result (NAME.records.jsonl, or NAME.json beside it): the prompt "
        "and output lengths of its successful requests, instead of --isl/--osl",
    )
    ttft_ms: float | None = opt(None, "TTFT target, ms (required)")
    itl_ms: float | None = opt(None, "inter-token latency target, ms (required)")
    percentile: str = opt(
        "p99", "the share of requests that must meet both targets", choices=PERCENTILE_CHOICES
    )
    max_cpus: float | None = opt(None, "CPU budget of the fleet (default: this host's CPUs)")
    max_gpus: float | None = opt(None, "GPU budget of the fleet (default: this host's GPUs)")
    profile: str | None = opt(None, "reuse this saved profile instead of profiling")
    profile_out: str | None = opt(
        None, "where the measured profile goes (default: RESULT_DIR/plan-profile.json)"
    )
    plot: str | None = opt(None, "the attainment plot (default: RESULT_DIR/plan-attainment.png)")
    result_dir: str = opt("perf/results", "where the default profile and plot files go")
    quick: bool = opt(False, "a few seconds of profiling at short lengths (tests, a first look)")
    prefill_lens: str = opt("", "prompt lengths to profile, comma separated (default by device)")
    decode_batches: str = opt("", "decode batch sizes to profile, comma separated")
    decode_contexts: str = opt("", "decode context lengths to profile, comma separated")
    decode_steps: int = opt(
        0, "timed decode steps per batch and context, in each pass over the grid (0: by device)"
    )
    sim_seconds: float = opt(120.0, "simulated seconds of load per configuration")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, PlanConfig, EngineConfig)


def _lengths(flag: str, text: str) -> tuple[int, ...] | None:
    if not text.strip():
        return None
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise PlanInputError(f"{flag} takes whole numbers, comma separated: {text!r}") from None
    if not values or values[0] < 1:
        raise PlanInputError(f"{flag} values must be >= 1: {text!r}")
    return tuple(values)


def _positive(cfg: PlanConfig, name: str, required: bool) -> None:
    value, flag = getattr(cfg, name), "--" + name.replace("_", "-")
    if value is None:
        if required:
            raise PlanInputError(f"{flag} is required")
    elif not (value > 0 and math.isfinite(value)):
        raise PlanInputError(f"{flag} must be a positive number, got {value:g}")


def workload_of(cfg: PlanConfig):
    from pdserve.services.control.planner.workload import Workload

    _positive(cfg, "request_rate", required=not cfg.workload_records)
    if cfg.workload_records:
        if cfg.isl is not None or cfg.osl is not None:
            raise PlanInputError("--isl/--osl and --workload-records exclude each other")
        path = Path(cfg.workload_records)
        jsonl = path.with_suffix(".records.jsonl") if path.suffix == ".json" else path
        if not jsonl.is_file():
            raise PlanInputError(f"--workload-records {jsonl}: no such file")
        try:
            return Workload.from_bench_records(path, request_rate=cfg.request_rate)
        except (ValueError, KeyError, TypeError) as exc:
            what = f"a record lacks {exc}" if isinstance(exc, KeyError) else str(exc)
            raise PlanInputError(f"--workload-records {jsonl}: {what}") from None
    for name in ("isl", "osl"):
        _positive(cfg, name, required=True)
    return Workload(request_rate=cfg.request_rate, isl=cfg.isl, osl=cfg.osl)


def slo_of(cfg: PlanConfig):
    from pdserve.services.control.planner.workload import SLO

    _positive(cfg, "ttft_ms", required=True)
    _positive(cfg, "itl_ms", required=True)
    if cfg.percentile not in PERCENTILE_CHOICES:  # from the environment: argparse skipped it
        raise PlanInputError(f"--percentile must be one of {', '.join(PERCENTILE_CHOICES)}")
    return SLO(cfg.ttft_ms, cfg.itl_ms, cfg.percentile)


def limits_of(cfg: PlanConfig, unit: str, prefill_cost: float, decode_cost: float):
    """Min one worker of each role; the max of each what the budget leaves beside the other's
    minimum; the budget the flag of the profile's unit, else this host's."""
    from pdserve.services.control.planner.inputs import Limits

    _positive(cfg, "max_cpus", required=False)
    _positive(cfg, "max_gpus", required=False)
    if cfg.max_cpus is not None and cfg.max_gpus is not None:
        raise PlanInputError("give one budget: --max-cpus or --max-gpus")
    given, other = (cfg.max_gpus, cfg.max_cpus) if unit == "GPU" else (cfg.max_cpus, cfg.max_gpus)
    if other is not None:
        flag = "--max-cpus" if unit == "GPU" else "--max-gpus"
        raise PlanInputError(
            f"{flag}: the profile's workers run on {unit}s; budget them in {unit}s"
        )
    budget = given if given is not None else host_budget(unit)
    most = {
        role: max(1, int((budget - other_cost) / cost + 1e-9))
        for role, cost, other_cost in (
            ("prefill", prefill_cost, decode_cost),
            ("decode", decode_cost, prefill_cost),
        )
    }
    try:
        return Limits(
            max_prefill=most["prefill"],
            max_decode=most["decode"],
            prefill_cost=prefill_cost,
            decode_cost=decode_cost,
            budget=budget,
            unit=unit,
        )
    except ValueError as exc:
        raise PlanInputError(f"{exc} (a prefill and a decode worker at the least)") from None


def host_budget(unit: str) -> float:
    if unit == "GPU":
        from pdserve.services.control.processes import visible_gpus

        return float(len(visible_gpus()) or 1)
    return float(len(os.sched_getaffinity(0)))


def settings_of(cfg: PlanConfig, gpu: bool):
    import dataclasses

    from pdserve.services.control.planner.profile_run import ProfileSettings

    settings = ProfileSettings.default(quick=cfg.quick, gpu=gpu)
    if cfg.decode_steps < 0:
        raise PlanInputError(f"--decode-steps must be >= 0, got {cfg.decode_steps}")
    overrides = {
        "prefill_lens": _lengths("--prefill-lens", cfg.prefill_lens),
        "decode_batches": _lengths("--decode-batches", cfg.decode_batches),
        "decode_contexts": _lengths("--decode-contexts", cfg.decode_contexts),
        "decode_steps": cfg.decode_steps or None,
    }
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def _progress(text: str) -> None:
    print(f"pdserve plan: {text}", file=sys.stderr, flush=True)


def up_command(best) -> str:
    if best.aggregated:
        return f"pdserve up --prefill-workers 0 --decode-workers {best.aggregated}"
    return f"pdserve up --prefill-workers {best.prefill} --decode-workers {best.decode}"


def run(ns: argparse.Namespace) -> int:
    from pdserve.services.control.planner import profile_run
    from pdserve.services.control.planner.advisor import advise, plot_attainment

    cfg, engine = build(PlanConfig, ns), build(EngineConfig, ns)
    workload, slo = workload_of(cfg), slo_of(cfg)  # bad input fails before a minute of profiling
    result_dir = Path(cfg.result_dir)
    plot_path = Path(cfg.plot) if cfg.plot else result_dir / "plan-attainment.png"
    if cfg.profile:
        profile, run_info = profile_run.load_profile(Path(cfg.profile))
        limits = limits_of(
            cfg,
            run_info.get("unit", "GPU" if cfg.max_gpus is not None else "CPU"),
            float(run_info.get("prefill_cost", 1.0)),
            float(run_info.get("decode_cost", 1.0)),
        )
        saved = None
    else:
        gpu = profile_run.uses_gpu(engine)
        settings = settings_of(cfg, gpu)
        gpus = profile_run.visible_gpus() if gpu else []
        place = profile_run.placements(engine, sorted(os.sched_getaffinity(0)), gpus, gpu)
        unit = "GPU" if gpu else "CPU"
        limits = limits_of(cfg, unit, place["prefill"].cost, place["decode"].cost)
        profile, run_info = profile_run.run_profile(engine, settings, place, _progress)
        saved = Path(cfg.profile_out) if cfg.profile_out else result_dir / "plan-profile.json"
        profile_run.save_profile(profile, run_info, saved)
    _progress(f"simulating P:D configurations within {limits.budget:g} {limits.unit} ...")
    advice = advise(profile, workload, slo, limits, duration_s=cfg.sim_seconds)
    print(advice.report(), end="", flush=True)
    best, agg = advice.best, advice.best_aggregated
    if agg is not None and (best is None or agg.cost < best.cost):  # as the verdict reads
        best = agg
    tail = [
        f"budget: {limits.budget:g} {limits.unit}; a prefill worker costs"
        f" {limits.prefill_cost:g} {limits.unit}, a decode worker {limits.decode_cost:g}"
        + (" (the CPU share pdserve up gave each while profiling)" if limits.unit == "CPU" else "")
    ]
    if best is not None:
        tail.append(f"run it: {up_command(best)}")
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot_attainment(advice, plot_path)
    tail.append(f"attainment plot: {plot_path}")
    if saved is not None:
        tail.append(f"profile saved: {saved} (reuse it with --profile {saved})")
    print("\n".join(tail), flush=True)
    return 0
