"""The order in which a rollout retires the old version (services/control/rollout.py), with real child
processes standing in for workers and no model: the old prefill workers drain first, and the
old decode workers - the only ones that can pull the KV an old prefill worker leased, its
version being in the KV layout - keep serving until every old prefill worker has exited.
SIGTERMing both at once could leave a leg prefilled by v1 only v2 decode workers, whose pull is
refused (the likely cause of a 502 in a CI run)."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pdserve.services.control import rollout
from pdserve.services.control.processes import Child, spawn

# a worker's drain in miniature: on SIGTERM it finishes what it holds (a moment), then exits 0
WORKER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(0)))
print("ready", flush=True)
while True:
    time.sleep(60)
"""


@dataclass
class Fleet:
    started: dict[str, SimpleNamespace] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    worker: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(drain_seconds=5.0))
    common: dict = field(default_factory=dict)
    metrics_key: str | None = None
    gateway: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(api_key=["user-key"], admin_api_key=[])
    )


def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.fixture
def switching(monkeypatch, tmp_path):
    """A rollout past its probe, about to switch: old p0/d0 serving, new p1/d1 promoted."""
    fleet = Fleet()
    for name, role in (("p0", "prefill"), ("d0", "decode"), ("p1", "prefill"), ("d1", "decode")):
        child = spawn(name, [sys.executable, "-c", WORKER], log_path=tmp_path / name)
        fleet.children.append(child)
        fleet.started[name] = SimpleNamespace(role=role)
    for child in fleet.children:  # its SIGTERM handler is in place
        until(lambda c=child: c.log_path.read_text().startswith("ready"))

    # the gateway lists the new version: the switch may go on
    def models_card(url: str, key: str | None) -> dict:
        assert key == "user-key"  # /v1/models is read with the gateway's API key
        return {"model_versions": ["v1", "v2"]}

    monkeypatch.setattr(rollout, "models_card", models_card)
    r = object.__new__(rollout.Rollout)
    r.fleet, r.url, r.t0, r.times = fleet, "http://gateway", time.monotonic(), {}
    r.version, r.old_versions, r.probed = "v2", ["v1"], "ok"
    r.old = {c.name: c for c in fleet.children if c.name.endswith("0")}
    r.new = {c.name: c for c in fleet.children if c.name.endswith("1")}
    r.common, r.retiring = {}, set()
    r.phase, r.deadline = "switch", time.monotonic() + 10
    yield r, fleet
    for child in fleet.children:
        child.stop(1.0)


def test_old_prefill_workers_drain_before_old_decode_workers(switching) -> None:
    r, fleet = switching
    p0, d0 = r.old["p0"], r.old["d0"]
    assert r.poll() is None
    assert r.retiring == {p0.pid}  # only the prefill worker was told to drain
    assert d0.alive()
    seen_decode_alive_after_prefill = False
    while True:
        answer = r.poll()
        if p0.alive():
            assert d0.pid not in r.retiring  # decode keeps serving while prefill drains
        elif d0.alive():
            seen_decode_alive_after_prefill = True
        if answer is not None:
            break
        time.sleep(0.02)
    assert seen_decode_alive_after_prefill
    assert answer["ok"] and answer["exited"] == {"p0": 0, "d0": 0}
    assert r.retiring == {p0.pid, d0.pid}
    assert set(fleet.started) == {"p1", "d1"}  # the new version stays
    assert all(c.alive() for c in r.new.values())


def test_a_prefill_worker_past_its_drain_deadline_is_killed_then_decode_drains(switching) -> None:
    r, _ = switching
    p0 = r.old["p0"]
    p0.signal(signal.SIGSTOP)  # a stuck drain: it never exits on its own
    assert r.poll() is None
    r.deadline = time.monotonic() - 1  # its time is up
    answers: list[dict] = []
    until(lambda: (answer := r.poll()) is not None and not answers.append(answer))
    assert answers[0]["exited"] == {"p0": -signal.SIGKILL, "d0": 0}  # d0 drained in full
