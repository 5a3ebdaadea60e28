"""``pdserve up --autoscale`` without a model: the flags refused or clamped before anything
starts, the budget's limits, where a new worker goes, and the control loop acting on a stand-in
launcher whose workers are real processes that drain on SIGTERM (as worker_base does): a
scale-up starts one through the launcher's path, a scale-down drains the least loaded one, which
stops counting at once, is never reported as a crash, and is reaped when it exits. The planner's
own metrics are read over HTTP. (With real workers: tests/integration/test_autoscale.py.)"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.services.control import autoscale
from pdserve.services.control.autoscale import Autoscaler, Placement, WorkerStart, least_held
from pdserve.services.control.planner.inputs import MetricsWindow, WorkerSample
from pdserve.services.control.planner.profile import Profile
from pdserve.services.control.processes import Child, free_port, spawn
from pdserve.shared.config import EngineConfig, UpConfig, WorkerConfig
from pdserve.shared.cpus import cpu_shares
from pdserve.shared.errors import StartupError

# a worker stand-in: on SIGTERM it "drains" for a moment, then exits 0; once it can, it says
# so in the file named by its argument
WORKER = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(0)))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "while True:\n    signal.pause()\n"
)


def profile(path: Path) -> Path:
    """Prefill never binds; one decode worker does 40 tok/s (batch 1 at 25 ms; batch 2 misses
    any ITL target), so a window's decode need is rate x OSL / 40."""
    Profile(
        prefill_lens=(1, 4096),
        prefill_tokens_per_s=(1e6, 1e6),
        decode_batches=(1, 2),
        decode_contexts=(16, 4096),
        decode_itl_ms=((25.0, 25.0), (1e5, 1e5)),
        kv_capacity_tokens=100_000,
    ).save(path)
    return path


def up_config(tmp_path: Path, **kw) -> UpConfig:
    base = dict(
        autoscale=True,
        planner_profile=str(profile(tmp_path / "p.json")),
        slo_ttft_ms=1000.0,
        slo_itl_ms=50.0,
        planner_warmup_seconds=0.0,
    )
    return UpConfig(**{**base, **kw})


# ---- flags ----------------------------------------------------------------------------------


def test_without_a_profile_the_error_says_how_to_make_one() -> None:
    with pytest.raises(
        StartupError, match=r"--planner-profile FILE.*`pdserve plan --model M --profile-out FILE`"
    ):
        autoscale.settings(UpConfig(autoscale=True))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"planner_profile": "/nonexistent.json"}, "/nonexistent.json"),
        ({"autoscale_max_cpus": 4.0, "autoscale_max_gpus": 2}, "give one budget"),
        ({"prefill_workers": 0}, "not --prefill-workers 0"),
        ({"min_decode_workers": 3, "max_decode_workers": 2}, "--min-decode-workers <="),
        ({"min_prefill_workers": 0}, "1 <= --min-prefill-workers"),
        ({"autoscale_interval": 0.0}, "--autoscale-interval must be > 0"),
        ({"slo_itl_ms": 0.0}, "SLO targets must be positive"),
    ],
)
def test_bad_flags_are_refused_in_one_line(tmp_path: Path, flags: dict, message: str) -> None:
    with pytest.raises(StartupError, match=message):
        autoscale.settings(up_config(tmp_path, **flags))


def test_the_starting_counts_are_clamped_into_each_roles_range(tmp_path: Path) -> None:
    up = up_config(tmp_path, decode_workers=5, max_decode_workers=3, min_prefill_workers=2)
    autoscale.settings(up)
    assert (up.prefill_workers, up.decode_workers) == (2, 3)


def test_a_max_of_zero_is_what_the_budget_holds(tmp_path: Path) -> None:
    up = up_config(tmp_path, max_prefill_workers=1)
    limits = autoscale.fleet_limits(up, {"prefill": 1.0, "decode": 2.0}, 7.0, "CPU")
    assert (limits.max_prefill, limits.max_decode) == (1, 3)  # (7 - 1 prefill) / 2
    with pytest.raises(StartupError, match="minimum fleet costs 3 CPU > budget 2"):
        autoscale.fleet_limits(up, {"prefill": 1.0, "decode": 2.0}, 2.0, "CPU")


def test_a_new_worker_goes_where_the_fewest_workers_are() -> None:
    assert least_held([0, 1, 2, 3], [[0, 1], [2]], 1) == [3]
    assert least_held([0, 1, 2, 3], [[0, 1], [2], [3]], 2) == [0, 1]  # ties: pool order
    assert least_held(["0", "1"], [["0"], ["1"], ["0"]], 1) == ["1"]


# ---- the loop on a stand-in launcher ----------------------------------------------------------


class StandIn:
    """The parts of services/launcher.Launcher the autoscaler uses; its workers are processes
    that drain on SIGTERM."""

    def __init__(self, up: UpConfig, workdir: Path, gpus: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.up, self.engine = up, EngineConfig(model="demo", device="cpu")
        self.worker = WorkerConfig(drain_seconds=5.0)
        self.tps, self.gpus, self.common = {"prefill": 1, "decode": 1}, list(gpus), {}
        self.metrics_key: str | None = None  # the gateway's /metrics is open
        self.cpus = sorted(os.sched_getaffinity(0))
        self.cpu_shares = cpu_shares(self.cpus, [1, 1])
        self.children: list[Child] = []
        self.started: dict[str, WorkerStart] = {}
        self.added: list[tuple[str, Placement]] = []
        for i, role in enumerate(("prefill", "decode")):
            share = self.cpu_shares[i] if self.cpu_shares else None
            self._spawn(f"{role}-0", role, Placement(share, gpus[i] if gpus else None))

    def _spawn(self, name: str, role: str, place: Placement) -> Child:
        ready = self.workdir / f"{name}.ready"
        child = spawn(name, [sys.executable, "-c", WORKER, str(ready)], cpus=place.cpus)
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:  # its SIGTERM handler is set
            time.sleep(0.02)
        self.children.append(child)
        self.started[name] = WorkerStart(role, place, time.monotonic())
        return child

    def add_worker(self, role: str, place: Placement) -> Child:
        self.added.append((role, place))
        index = sum(1 for name in self.started if name.startswith(role))
        return self._spawn(f"{role}-{index}", role, place)


def window(
    scaler: Autoscaler, requests: int, busy: str = "", registered: bool = True
) -> MetricsWindow:
    """Two seconds with ``requests`` of ISL 16 / OSL 32; ``busy`` runs 3 sequences. With
    ``registered``, every serving worker is (the gateway the tests leave out would list it)."""
    for name in scaler.serving() if registered else ():
        scaler.joined.setdefault(name, time.monotonic())
    workers = tuple(
        WorkerSample(name, w.role, w.age_s, running=3 if name == busy else 0, loading=w.loading)
        for name, w in scaler.serving().items()
    )
    return scaler.with_fleet(
        MetricsWindow(
            duration_s=2.0,
            requests=requests,
            mean_isl=16.0,
            mean_osl=32.0,
            ttft_ms=500.0 if requests else None,
            itl_ms=20.0 if requests else None,
            workers=workers,
        )
    )


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        lines = resp.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("pdserve_planner_") and not line.startswith("#")
    }


def test_the_loop_starts_under_load_and_drains_when_idle(tmp_path: Path) -> None:
    port = free_port()
    up = up_config(
        tmp_path, max_decode_workers=2, autoscale_max_cpus=3.0, planner_metrics_port=port
    )
    fleet = StandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        scaler.begin("http://127.0.0.1:1")  # no gateway there: a window is skipped, no crash
        assert scaler.counts().decode == 1
        assert scrape(port)['pdserve_planner_desired_workers{role="decode"}'] == 1.0

        # 5 req/s x 32 tokens = 160 tok/s = 4 workers' worth: up to the max, 2
        decision = scaler.step(window(scaler, 10, busy="decode-0"))
        assert decision.decode == 2 and scaler.counts().decode == 2
        role, place = fleet.added[-1]
        if fleet.cpu_shares is not None:  # 1 CPU a rank: the CPUs fewest workers hold
            assert place.cpus == least_held(fleet.cpus, [s for s in fleet.cpu_shares], 1)
        metrics = scrape(port)
        assert metrics['pdserve_planner_desired_workers{role="decode"}'] == 2.0
        assert metrics['pdserve_planner_current_workers{role="decode"}'] == 2.0
        assert metrics['pdserve_planner_scaling_actions_total{direction="up",role="decode"}'] == 1

        # no arrivals while decode-0 still runs a stream: nothing moves [idle-window]
        held = scaler.step(window(scaler, 0, busy="decode-0"))
        assert held.decode == 2 and "idle-window" in held.rules
        # a trickle (0.5 req/s: 0.4 of a worker): down to the minimum once the forecast has
        # come down to it; the load is forecast to fall, so the first window whose need fits
        # one worker drains (no two-window streak). decode-0 still runs a stream, so the idle
        # newcomer is the one drained
        asked = [scaler.step(window(scaler, 1, busy="decode-0")) for _ in range(12)]
        first = next(i for i, d in enumerate(asked) if d.decode == 1)
        assert first > 0 and asked[first - 1].decode == 2 and asked[first - 1].need["decode"] > 1
        assert "falling" in asked[first].rules and asked[first].need["decode"] <= 1
        assert scaler.counts().decode == 1  # the draining worker is no capacity at once
        drained = next(c for c in fleet.children if c.name == "decode-1")
        assert scaler.retired(drained)
        assert not scaler.retired(next(c for c in fleet.children if c.name == "decode-0"))
        assert scrape(port)['pdserve_planner_draining_workers{role="decode"}'] == 1.0
        deadline = time.monotonic() + 10
        while drained in fleet.children and time.monotonic() < deadline:
            scaler.poll()
            time.sleep(0.05)
        assert drained not in fleet.children and "decode-1" not in fleet.started
        assert drained.popen.returncode == 0  # it drained and exited on its own
        metrics = scrape(port)
        assert metrics['pdserve_planner_draining_workers{role="decode"}'] == 0.0
        assert metrics['pdserve_planner_current_workers{role="decode"}'] == 1.0
        assert metrics['pdserve_planner_scaling_actions_total{direction="down",role="decode"}'] == 1
    finally:
        scaler.close()
        for child in fleet.children:
            child.stop(2.0)


def test_a_worker_that_dies_on_its_own_is_replaced_and_not_retired(tmp_path: Path) -> None:
    up = up_config(tmp_path, max_decode_workers=2, autoscale_max_cpus=3.0)
    fleet = StandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        crashed = next(c for c in fleet.children if c.name == "decode-0")
        crashed.stop(2.0)
        assert not scaler.retired(crashed) and scaler.counts().decode == 0
        assert scaler.step(window(scaler, 0)).decode == 1  # the minimum, at once
        assert [role for role, _ in fleet.added] == ["decode"]
    finally:
        scaler.close()
        for child in fleet.children:
            child.stop(2.0)


@pytest.mark.parametrize("oversubscribed", [True, False])
def test_a_budget_beyond_the_cpus_has_the_planner_fit_its_counts_to_them(
    tmp_path: Path, oversubscribed: bool
) -> None:
    here = len(os.sched_getaffinity(0))
    budget = here + 2.0 if oversubscribed else float(here)
    up = up_config(tmp_path, autoscale_max_cpus=budget)
    fleet = StandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        assert scaler.planner.config.host_cpus == (here if oversubscribed else None)
    finally:
        scaler.close()
        for child in fleet.children:
            child.stop(2.0)


def test_on_gpus_a_worker_costs_a_gpu_per_rank_and_takes_one_nobody_uses(tmp_path: Path) -> None:
    """No CUDA needed: placement is bookkeeping. Three GPUs, 1P1D on the first two: the budget
    (the GPUs here) holds one more decode worker, which gets the third GPU."""
    up = up_config(tmp_path)
    fleet = StandIn(up, tmp_path, gpus=("0", "1", "2"))
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        limits = scaler.planner.limits
        assert (scaler.unit, limits.budget, limits.decode_cost) == ("GPU", 3.0, 1.0)
        assert (limits.max_prefill, limits.max_decode) == (2, 2)
        assert scaler.step(window(scaler, 10)).decode == 2
        assert fleet.added[-1][1].gpu == "2"
    finally:
        scaler.close()
        for child in fleet.children:
            child.stop(2.0)
