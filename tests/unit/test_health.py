"""/ready and /live beside /metrics (shared/telemetry/health.py, metrics.start_metrics_server):
each phase's answer, a stalled event loop, and the HTTP server that serves them. Real workers
answering them: tests/integration/test_probes.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from pdserve.shared.telemetry import health, metrics


def test_ready_only_once_on_the_bus_and_not_draining() -> None:
    h = health.Health(lambda: {"requests": 2, "leases": 5})
    assert h.ready() == (503, {"status": "loading", "reason": "loading the model"})
    h.enter(health.JOINING)
    status, body = h.ready()
    assert status == 503 and body["status"] == "joining" and "NATS" in body["reason"]
    h.enter(health.READY)
    assert h.ready() == (200, {"status": "ready", "requests": 2, "leases": 5})
    h.enter(health.DRAINING)
    status, body = h.ready()
    assert status == 503 and body["status"] == "draining" and body["leases"] == 5
    assert "no new requests" in body["reason"]


def test_not_ready_while_cut_off_from_nats() -> None:
    up = [True]
    h = health.Health(connected=lambda: up[0])
    h.enter(health.READY)
    assert h.ready()[0] == 200
    up[0] = False
    status, body = h.ready()
    assert status == 503 and "not connected to NATS" in body["reason"]


def test_live_fails_only_when_the_event_loop_stalls() -> None:
    h = health.Health(stall_seconds=0.05)
    h._tick -= 10  # loading a checkpoint for a while: nothing to stall yet
    assert h.live() == (200, {"status": "alive", "phase": "loading"})
    h.enter(health.READY)  # entering a phase counts as a turn of the loop
    assert h.live()[0] == 200
    h._tick -= 1.0
    status, body = h.live()
    assert status == 503 and body["status"] == "stalled" and "has not turned" in body["reason"]
    h.tick()
    assert h.live()[0] == 200


def get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers["Content-Type"]


def test_the_metrics_server_answers_probes_beside_metrics() -> None:
    registry = CollectorRegistry()
    Counter("pdserve_probe_test", "a counter", registry=registry).inc()
    h = health.Health(lambda: {"requests": 1})
    server = metrics.start_metrics_server(0, registry, addr="127.0.0.1", probes=h.probes())
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, body, kind = get(base + "/ready")
        assert status == 503 and kind == "application/json"
        assert json.loads(body)["status"] == "loading"
        h.enter(health.READY)
        status, body, _ = get(base + "/ready")
        assert status == 200 and json.loads(body) == {"status": "ready", "requests": 1}
        status, body, _ = get(base + "/live")
        assert status == 200 and json.loads(body)["status"] == "alive"
        status, body, _ = get(base + "/metrics")
        assert status == 200 and b"pdserve_probe_test_total 1.0" in body
    finally:
        server.close()
