"""The profile of ``pdserve plan``: what one prefill and one decode worker do on this machine, from
short real runs, saved as a ``Profile`` (services/control/planner/profile.py) that ``pdserve plan --profile``
and ``pdserve up --autoscale`` read back.

Each role runs in a child process (measure.py), one after the other so they never compete, placed
as ``pdserve up``'s default 1 prefill + 1 decode placement would place that role's worker: the CPU
share ``shared/cpus.cpu_shares`` gives it (with fewer CPUs than ranks: all of them, at the
launcher's thread count), or its own GPU(s) by the launcher's round-robin. The measured ITL is
therefore the ITL of a worker with that many CPUs; what one worker costs (``RolePlacement.cost``,
in CPUs or GPUs) is recorded beside the curves, so the advice counts workers in the same unit.

The JSON is ``Profile.to_dict()`` plus a ``"run"`` section (device, costs, threads, CPUs, the
engine options that shape the curves, the lengths asked for, seconds taken). ``Profile.load``
ignores that section; ``load_profile`` returns it too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.processes import gpu_for_worker, spawn, visible_gpus
from pdserve.shared.config import EngineConfig
from pdserve.shared.cpus import cpu_shares
from pdserve.shared.errors import StartupError

ROLE_TIMEOUT_S = 1800.0  # a large model on a slow machine: loading alone may take minutes
# the options that change what a step costs, recorded so a profile says what it measured
SHAPING_OPTIONS = (
    "model",
    "device",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "speculative",
)


class ProfileError(StartupError):
    """Profiling could not run or a saved profile cannot be read: one line for the CLI."""


@dataclass(frozen=True)
class ProfileSettings:
    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int  # timed steps per decode cell and pass (after one warm-up step)
    decode_passes: int  # passes over the decode grid (measure.measure_decode says why)
    prefill_reps: int  # most repetitions of one prompt length
    rep_seconds: float  # ... and no more once they took this long

    @classmethod
    def default(cls, *, quick: bool, gpu: bool) -> ProfileSettings:
        """About a minute for SmolLM2 on 2 CPUs; ``quick``, seconds on the demo model (tests)."""
        if quick:
            return cls(
                prefill_lens=(64, 256, 1024),
                decode_batches=(1, 2, 4),
                decode_contexts=(64, 256),
                decode_steps=10,
                decode_passes=1,
                prefill_reps=3,
                rep_seconds=0.5,
            )
        if gpu:  # steps cost milliseconds: batches up to the engine's default cap
            return cls(
                prefill_lens=(128, 512, 2048, 8192),
                decode_batches=(1, 2, 4, 8, 16, 32, 64),
                decode_contexts=(256, 1024, 4096),
                decode_steps=10,
                decode_passes=2,
                prefill_reps=5,
                rep_seconds=2.0,
            )
        return cls(
            prefill_lens=(128, 512, 2048),
            decode_batches=(1, 2, 4, 8),
            decode_contexts=(256, 1024, 4096),
            decode_steps=3,
            decode_passes=5,
            prefill_reps=7,
            rep_seconds=4.0,
        )

    def capped(self, max_num_seqs: int) -> ProfileSettings:
        """Batches the engine can run (``--max-num-seqs``); the largest always measured."""
        batches = tuple(b for b in self.decode_batches if b <= max_num_seqs)
        if max_num_seqs not in batches and max_num_seqs < self.decode_batches[-1]:
            batches += (max_num_seqs,)
        return dataclasses.replace(self, decode_batches=batches)


@dataclass(frozen=True)
class RolePlacement:
    cpus: list[int] | None  # the affinity of the role's process (None: every CPU, shared)
    torch_threads: int  # the engine option the launcher hands the worker (0: its share's size)
    gpus: str | None  # CUDA_VISIBLE_DEVICES (None: left alone)
    cost: float  # CPUs (on a CPU) or GPUs one worker of this role takes


def placements(
    engine: EngineConfig, cpus: list[int], gpus: list[str], on_gpu: bool
) -> dict[str, RolePlacement]:
    """Where ``pdserve up`` with one prefill and one decode worker puts each (launcher.py's
    ``_plan_cpus`` and ``_start_worker``), and what a worker of each role costs."""
    tp = engine.tensor_parallel_size
    shares = cpu_shares(cpus, [tp, tp])
    threads = engine.torch_threads
    if shares is None and not threads:  # fewer CPUs than ranks: all share them, a thread each
        threads = max(1, len(cpus) // (2 * tp))
    out = {}
    for slot, role in enumerate(("prefill", "decode")):
        share = shares[slot] if shares else None
        cost = float(tp) if on_gpu else float(len(share) if share else len(cpus) / 2)
        gpu = gpu_for_worker(slot * tp, gpus, tp) if on_gpu else None
        out[role] = RolePlacement(cpus=share, torch_threads=threads, gpus=gpu, cost=cost)
    return out


def cpu_busy(cpus: list[int], seconds: float = 0.5) -> float | None:
    """The busy share of ``cpus`` over ``seconds`` (0..1, from /proc/stat), what other processes
    use right now (the load average lags by minutes); None where /proc/stat is unreadable."""

    def sample() -> dict[int, tuple[int, int]]:
        out = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(f) for f in fields[:8]]
                out[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])  # total, idle + iowait
        return out

    try:
        first = sample()
        time.sleep(seconds)
        second = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = sum(second[c][0] - first[c][0] for c in cpus if c in first and c in second)
    idle = sum(second[c][1] - first[c][1] for c in cpus if c in first and c in second)
    return 1.0 - idle / total if total > 0 else None


def busy_note(busy: float | None, cpus: int) -> str:
    """A warning when other processes kept the CPUs busy as profiling began: the curves would
    then be slower than what a worker does on CPUs of its own."""
    if busy is None or busy <= 0.25:
        return ""
    return f"busy machine ({100 * busy:.0f}% of {cpus} CPUs in use): the curves may read slow"


def uses_gpu(engine: EngineConfig) -> bool:
    """Whether the engine runs on a GPU, found without importing torch (as ``pdserve up``)."""
    if engine.device == "auto":
        return bool(visible_gpus())
    return engine.device.startswith("cuda")


def _measure_role(
    role: str,
    engine: EngineConfig,
    place: RolePlacement,
    spec: dict[str, Any],
    workdir: Path,
) -> dict[str, Any]:
    config = dataclasses.replace(engine, torch_threads=place.torch_threads)
    spec_path, out_path = workdir / f"{role}.spec.json", workdir / f"{role}.out.json"
    spec_path.write_text(json.dumps({"role": role, "engine": dataclasses.asdict(config), **spec}))
    env = dict(os.environ)
    if place.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = place.gpus
    argv = [
        sys.executable,
        "-m",
        "pdserve.services.control.planner.measure",
        str(spec_path),
        str(out_path),
    ]
    child = spawn(f"plan-{role}", argv, env, cpus=place.cpus)
    try:
        child.popen.wait(timeout=ROLE_TIMEOUT_S)
    except BaseException:  # a timeout or Ctrl-C: the child goes too
        child.popen.kill()
        child.popen.wait()
        raise
    try:
        result = json.loads(out_path.read_text())
    except (OSError, ValueError):
        result = {"error": f"the {role} run exited with {child.popen.returncode} and no result"}
    if "error" in result:
        raise ProfileError(f"profiling the {role} worker failed: {result['error']}")
    return result


def run_profile(
    engine: EngineConfig,
    settings: ProfileSettings,
    place: dict[str, RolePlacement],
    progress: Callable[[str], None],
) -> tuple[Profile, dict[str, Any]]:
    """Measure both roles and return the profile with its ``run`` section."""
    settings = settings.capped(engine.max_num_seqs)
    cpus = sorted(os.sched_getaffinity(0))
    busy_before = cpu_busy(cpus)
    started, busy = time.perf_counter(), busy_note(busy_before, len(cpus))
    if busy:
        progress(f"warning: {busy}")
    with tempfile.TemporaryDirectory(prefix="pdserve-plan-") as tmp:
        results = {}
        for role, spec in (
            (
                "prefill",
                {
                    "lens": list(settings.prefill_lens),
                    "reps": settings.prefill_reps,
                    "rep_seconds": settings.rep_seconds,
                },
            ),
            (
                "decode",
                {
                    "batches": list(settings.decode_batches),
                    "contexts": list(settings.decode_contexts),
                    "steps": settings.decode_steps,
                    "passes": settings.decode_passes,
                },
            ),
        ):
            p = place[role]
            where = f"GPU {p.gpus}" if p.gpus else f"CPUs {p.cpus}" if p.cpus else "all CPUs"
            progress(f"profiling a {role} worker ({where}) ...")
            results[role] = _measure_role(role, engine, p, spec, Path(tmp))
    pre, dec = results["prefill"], results["decode"]
    threads = f"prefill {pre['threads']}, decode {dec['threads']} torch thread(s)"
    hardware = f"{dec['device']}: {dec['hardware']}" + (
        f" ({threads})" if dec["device"] == "cpu" else ""
    )
    seconds = round(time.perf_counter() - started, 1)
    profile = Profile.from_points(
        [(int(n), float(tps)) for n, tps, _ in pre["points"]],
        [(int(b), int(c), float(itl)) for b, c, itl in dec["points"]],
        kv_capacity_tokens=int(dec["kv_capacity_tokens"]),
        max_batch=min(engine.max_num_seqs, max(int(b) for b, _, _ in dec["points"])),
        prefill_batch_tokens=engine.max_num_batched_tokens,
        model=dec["model"],
        hardware=hardware,
        note=f"pdserve plan, {dec['dtype']}, measured in {seconds:g} s"
        + (f"; {busy}" if busy else ""),
    )
    run = {
        "device": dec["device"],
        "unit": "GPU" if dec["device"] == "cuda" else "CPU",
        "prefill_cost": place["prefill"].cost,
        "decode_cost": place["decode"].cost,
        "prefill_threads": pre["threads"],
        "decode_threads": dec["threads"],
        "prefill_cpus": pre["cpus"],
        "decode_cpus": dec["cpus"],
        "engine": {k: getattr(engine, k) for k in SHAPING_OPTIONS},
        "settings": dataclasses.asdict(settings),
        "seconds": seconds,
        "cpu_busy_before": busy_before,  # the CPUs' busy share just before profiling began
    }
    return profile, run


def save_profile(profile: Profile, run: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**profile.to_dict(), "run": run}, indent=1) + "\n")


def load_profile(path: Path) -> tuple[Profile, dict[str, Any]]:
    """A saved profile and its ``run`` section ({} for a profile written without one)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"--profile {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"--profile {path}: not a profile JSON file ({exc})") from None
    try:
        return Profile.from_dict(doc), dict(doc.get("run") or {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ProfileError(f"--profile {path}: not a usable profile ({what})") from None
