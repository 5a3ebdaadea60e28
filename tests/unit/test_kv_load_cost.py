"""The KV tiers' measured load costs (services/engine/kv_tiers/load_cost.py): seconds to load a
block from a tier over seconds to prefill one block's tokens, moving averages of what the worker
did, 0 until both sides are measured; what WorkerLoad carries and the router reads."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.gateway.router import DEFAULT_LOAD_COST, Router
from pdserve.services.engine.kv_tiers.load_cost import ALPHA, CopyTimer, LoadCosts
from tests.unit.test_router_tiers import load


def test_zero_until_both_sides_are_measured():
    costs = LoadCosts(block_size=16)
    assert costs.load_fields() == {"kv_host_load_cost": 0.0, "kv_disk_load_cost": 0.0}
    costs.observe_load("host", 4, 0.004)
    assert costs.cost("host") == 0.0  # no prefill measured yet
    costs.observe_prefill(0, 1.0)  # nothing computed: no sample
    costs.observe_prefill(160, 0.0)  # no time: no sample
    assert costs.cost("host") == 0.0
    costs.observe_prefill(160, 0.16)  # 1 ms a token: 16 ms a block
    assert costs.cost("host") == pytest.approx(0.001 / 0.016)
    assert costs.cost("disk") == 0.0  # never loaded from disk


def test_moving_averages_follow_what_the_worker_does():
    costs = LoadCosts(block_size=8)
    costs.observe_prefill(100, 0.1)
    costs.observe_load("disk", 2, 0.004)  # 2 ms a block
    assert costs.cost("disk") == pytest.approx(0.002 / 0.008)
    costs.observe_load("disk", 1, 0.012)  # a slower read moves the average by ALPHA
    want = 0.002 + ALPHA * (0.012 - 0.002)
    assert costs.block_seconds["disk"] == pytest.approx(want)
    for _ in range(60):  # a lasting change wins
        costs.observe_load("disk", 1, 0.008)
    assert costs.cost("disk") == pytest.approx(1.0, rel=1e-3)
    worker = replace(load("p0"), **costs.load_fields())  # what the heartbeat carries
    router = Router(lambda role: [worker], 8)
    assert router.load_cost(worker, "disk") == pytest.approx(1.0, rel=1e-3)  # measured
    assert router.load_cost(worker, "host") == DEFAULT_LOAD_COST["host"]  # not: the default


def test_cpu_copies_are_timed_when_done():
    costs = LoadCosts(block_size=16)
    timer = CopyTimer(costs, cuda=False)
    started = timer.start()
    time.sleep(0.01)
    timer.stop(started, 2)
    assert costs.block_seconds["host"] >= 0.005  # per block: half the time of two
    timer.poll()  # nothing pending on CPU
