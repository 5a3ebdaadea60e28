"""The warm pool without a model: the bookkeeping (services/control/warm_pool.py), its flags, its cost
against the budget, and the autoscaler on a stand-in launcher whose workers are processes that
note a promotion (SIGUSR1) as services/standby.py does: a scale-up promotes a registered pooled
worker instead of a cold start, then refills the pool; one not registered yet is passed over;
one that died is replaced. (With real workers: tests/integration/test_warm_pool.py.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pdserve.services.control import autoscale
from pdserve.services.control.autoscale import Autoscaler, Placement
from pdserve.services.control.planner.guards import pick_to_drain
from pdserve.services.control.planner.inputs import Counts
from pdserve.services.control.processes import Child, spawn
from pdserve.services.control.warm_pool import WarmPool
from pdserve.shared.config import UpConfig
from pdserve.shared.errors import StartupError
from tests.unit.test_autoscale import StandIn, up_config, window

# a worker stand-in: SIGTERM drains (exits 0), SIGUSR1 promotes (a file says it was)
WORKER = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.1), sys.exit(0)))\n"
    "signal.signal(signal.SIGUSR1, lambda *_: pathlib.Path(sys.argv[1] + '.promoted').touch())\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "while True:\n    signal.pause()\n"
)


class PoolStandIn(StandIn):
    """StandIn whose added workers may start on standby, and survive SIGUSR1."""

    def __init__(self, up: UpConfig, workdir: Path) -> None:
        self.standby: dict[str, bool] = {}
        super().__init__(up, workdir)

    def _spawn(self, name: str, role: str, place: Placement) -> Child:
        ready = self.workdir / f"{name}.ready"
        child = spawn(name, [sys.executable, "-c", WORKER, str(ready)], cpus=place.cpus)
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.children.append(child)
        self.started[name] = autoscale.WorkerStart(role, place, time.monotonic())
        return child

    def add_worker(self, role: str, place: Placement, standby: bool = False) -> Child:
        child = super().add_worker(role, place)
        self.standby[child.name] = standby
        return child

    def promoted(self, name: str) -> bool:
        return (self.workdir / f"{name}.ready.promoted").exists()


def stop_all(scaler: Autoscaler, fleet: StandIn) -> None:
    scaler.close()
    for child in fleet.children:
        child.stop(2.0)


def wait_for(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- bookkeeping and flags ------------------------------------------------------------------


def test_the_pool_takes_the_oldest_ready_member_and_says_what_it_lacks() -> None:
    pool = WarmPool({"prefill": 1, "decode": 2})
    assert pool.missing() == ["prefill", "decode", "decode"]
    pool.add("decode-3", "decode")
    pool.add("decode-4", "decode")
    assert pool.missing() == ["prefill"]
    assert pool.take("decode", ready=lambda w: False) is None  # none registered yet
    assert pool.take("decode", ready=lambda w: w == "decode-4") == "decode-4"
    assert pool.of("decode") == ["decode-3"] and pool.missing() == ["prefill", "decode"]
    assert pool.forget_gone(alive={"prefill-9"}) == ["decode-3"]
    assert pool.cost({"prefill": 2.0, "decode": 1.0}) == 4.0 and pool.size() == 3


def test_a_pool_needs_autoscale_and_counts_are_not_negative() -> None:
    with pytest.raises(StartupError, match="add --autoscale"):
        WarmPool.from_flags(UpConfig(warm_decode_workers=1))
    with pytest.raises(StartupError, match=">= 0"):
        WarmPool.from_flags(UpConfig(autoscale=True, warm_prefill_workers=-1))
    assert WarmPool.from_flags(UpConfig()).size() == 0


def test_the_pool_costs_budget_but_serving_comes_first(tmp_path: Path) -> None:
    up = up_config(tmp_path, autoscale_max_cpus=4.0, warm_decode_workers=1)
    fleet = PoolStandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:  # the whole budget is serving's: 4 CPUs - 1 prefill minimum = 3 decode at most
        assert scaler.planner.limits.max_decode == 3
        assert scaler.planner.config.pool_floor == Counts(0, 1)
    finally:
        stop_all(scaler, fleet)
    small = up_config(tmp_path, autoscale_max_cpus=2.0, warm_decode_workers=1)
    fleet = PoolStandIn(small, tmp_path)
    try:  # 1P1D takes 2 CPUs: the floor could never be held
        with pytest.raises(StartupError, match="warm pool's floor cost 3 CPU > budget 2"):
            Autoscaler(fleet, autoscale.settings(small), "127.0.0.1")
    finally:
        for child in fleet.children:
            child.stop(2.0)


# ---- the loop -------------------------------------------------------------------------------


def test_a_scale_up_promotes_a_registered_pooled_worker_then_refills(tmp_path: Path) -> None:
    up = up_config(tmp_path, max_decode_workers=2, autoscale_max_cpus=4.0, warm_decode_workers=1)
    fleet = PoolStandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        scaler.refill()  # what the launcher does beside the starting fleet
        (pooled,) = scaler.pool.of("decode")
        assert fleet.standby[pooled] and scaler.counts().decode == 1  # no capacity yet
        assert pooled not in scaler.serving()
        scaler.joined[pooled] = time.monotonic()  # the gateway lists it (registered)

        assert scaler.step(window(scaler, 10, busy="decode-0")).decode == 2
        assert wait_for(lambda: fleet.promoted(pooled))  # SIGUSR1, not a cold start
        assert pooled in scaler.serving() and scaler.counts().decode == 2
        (refill,) = scaler.pool.of("decode")  # a new standby worker took its place
        assert refill != pooled and fleet.standby[refill]
        # only standby workers were added: the scale-up cold-started no serving worker
        assert fleet.standby == {pooled: True, refill: True}
        assert scaler.warm.labels("decode")._value.get() == 1.0
        up_actions = scaler.actions.labels("decode", "up")._value.get()
        assert up_actions == 1.0  # the promotion is the one scaling action
    finally:
        stop_all(scaler, fleet)


def test_a_pooled_worker_still_loading_is_promoted_once_it_registers(tmp_path: Path) -> None:
    """It serves sooner than a cold start would: it leaves the pool at once (capacity coming,
    never drained while it loads) and gets SIGUSR1 once the gateway lists it (a signal before
    its handler is set would kill it)."""
    up = up_config(tmp_path, max_decode_workers=2, autoscale_max_cpus=4.0, warm_decode_workers=1)
    fleet = PoolStandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        scaler.refill()
        (pooled,) = scaler.pool.of("decode")  # never registered: not in scaler.joined
        before = set(fleet.standby)
        decision = scaler.step(window(scaler, 10, busy="decode-0"))
        assert decision.decode == 2 and pooled not in scaler.pool
        assert all(fleet.standby[name] for name in set(fleet.standby) - before)  # no cold start
        assert scaler.serving()[pooled].loading and not fleet.promoted(pooled)
        loading = window(scaler, 0, registered=False)
        assert pick_to_drain(loading, "decode", 2) == ["decode-0"]  # never it
        scaler.joined[pooled] = time.monotonic()  # the gateway lists it now
        scaler._promote_joined()
        assert wait_for(lambda: fleet.promoted(pooled))
    finally:
        stop_all(scaler, fleet)


def test_a_pooled_worker_that_dies_is_replaced(tmp_path: Path) -> None:
    up = up_config(tmp_path, autoscale_max_cpus=4.0, warm_prefill_workers=1)
    fleet = PoolStandIn(up, tmp_path)
    scaler = Autoscaler(fleet, autoscale.settings(up), "127.0.0.1")
    try:
        scaler.refill()
        (pooled,) = scaler.pool.of("prefill")
        next(c for c in fleet.children if c.name == pooled).stop(2.0)
        scaler.poll()  # the supervision loop's call: refills between decisions
        (again,) = scaler.pool.of("prefill")
        assert again != pooled and fleet.standby[again]
    finally:
        stop_all(scaler, fleet)
