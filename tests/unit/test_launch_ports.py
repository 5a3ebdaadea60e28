"""Ports ``pdserve up`` has promised to its services are never handed to its private NATS: a
caller picks the gateway's port free, and it stays free until the gateway binds it, after NATS
started (a fresh-clone CI run once saw the readiness probe reach a NATS server there)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve.services.control import processes
from pdserve.services.control.launch_checks import promised_ports
from pdserve.services.control.processes import NatsCluster, free_port
from pdserve.shared.config import GatewayConfig, UpConfig, WorkerConfig


def test_free_port_skips_the_ports_it_must_avoid(monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernel offers the promised port first: free_port asks again
    offered = iter([5001, 5001, 5002])

    class FakeSocket:
        def __init__(self, *args: object) -> None:
            self.port = next(offered)

        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes.socket, "socket", FakeSocket)
    assert free_port(avoid={5001}) == 5002


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_promised_ports_cover_every_service_and_rank() -> None:
    up = UpConfig(planner_metrics_port=9400)
    worker = WorkerConfig(metrics_port=9100, ucx_port=13337)
    ports = promised_ports(up, GatewayConfig(port=8123), worker, workers=3, ranks=4)
    assert ports == {8123, 9400, 9100, 9101, 9102, 13337, 13338, 13339, 13340}
    # a port of 0 is not promised: it is picked where it is bound
    assert promised_ports(UpConfig(), GatewayConfig(port=8123), WorkerConfig(), 2, 2) == {8123}


def test_cluster_nodes_take_distinct_ports_clear_of_the_promised(tmp_path: Path) -> None:
    promised = frozenset(range(1, 3))
    cluster = NatsCluster.local(3, tmp_path, avoid_ports=promised)
    ports = [p for n in cluster.nodes for p in (n.port, n.cluster_port, n.monitor_port)]
    assert len(set(ports)) == 9 and not set(ports) & promised
    assert all(n.avoid_ports == promised for n in cluster.nodes)
