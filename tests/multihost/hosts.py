"""pdserve spread over the namespace "hosts" of ``netns.py``, as over three machines.

    host a: NATS node-1 + the gateway
    host b: NATS node-2 + prefill worker p0
    host c: NATS node-3 + decode worker d0

The nodes form one cluster (explicit routes, every node to every other, on the hosts' 198.18
addresses); each process connects to its own host's node first and lists the other two for
failover. Workers bind KV transfer and /metrics to their own host's 198.18 address
(``--ucx-host``), so KV can only cross the bridge. The test driver, in the root namespace, has
no route to 198.18/15: it reaches the gateway's HTTP and each node's monitor port (and checks
that a node is up) over the hosts' link-local addresses only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.services.control.launcher import service_argv
from pdserve.services.control.processes import Child, NatsCluster, NatsServer, spawn
from pdserve.shared.options import service_env
from tests.integration.migration_stack import worker_blocks
from tests.integration.stack import QUIET_ENV, stop_all
from tests.multihost import netns
from tests.multihost.netns import Host, Topology

NATS_PORT = 4222  # each namespace has its own port space: the usual ports are free
ROUTE_PORT = 6222
MONITOR_PORT = 8222
GATEWAY_PORT = 8000
ROLES = {"a": "gateway", "b": "prefill", "c": "decode"}
WORKER_IDS = {"b": "p0", "c": "d0"}


def cluster_on(topo: Topology, logs: Path) -> NatsCluster:
    nodes = [
        NatsServer(
            host=host.address,  # what clients and the other nodes are given
            listen="0.0.0.0",  # the namespace's own addresses: 198.18 and link-local
            reach=host.mgmt,  # the driver's way in
            port=NATS_PORT,
            cluster_port=ROUTE_PORT,
            monitor_port=MONITOR_PORT,
            server_name=f"node-{i + 1}",
            log_path=logs / f"nats-{host.name}.log",
            workdir=logs,
            argv_prefix=host.argv(),
        )
        for i, host in enumerate(topo.hosts.values())
    ]
    return NatsCluster(nodes)


@dataclass
class MultiHostStack:
    topo: Topology
    cluster: NatsCluster
    logs: Path
    children: dict[str, Child] = field(default_factory=dict)  # by host name

    @property
    def base_url(self) -> str:
        return f"http://{self.topo.hosts['a'].mgmt}:{GATEWAY_PORT}"

    def node_of(self, host: str) -> NatsServer:
        return self.cluster.nodes[list(self.topo.hosts).index(host)]

    def nats_url_of(self, host: str) -> str:
        return self.cluster.client_url(list(self.topo.hosts).index(host))

    def start_service(self, host_name: str, options: dict[str, object]) -> Child:
        host: Host = self.topo.hosts[host_name]
        role = ROLES[host_name]
        base = {**netns.inherited_env(), **QUIET_ENV}
        values: dict[str, object] = {"nats_url": self.nats_url_of(host_name), **options}
        if role == "gateway":
            values.update(host=host.mgmt, port=GATEWAY_PORT)  # HTTP for the driver alone
        else:
            values.update(ucx_host=host.address, worker_id=WORKER_IDS[host_name])
        env = service_env(values, base)
        name = f"{role}-{host_name}"
        argv = host.argv(*service_argv(role))
        child = spawn(name, argv, env, self.logs / f"{name}.log")
        self.children[host_name] = child
        return child

    def log(self, host_name: str, tail: int = 3000) -> str:
        child = self.children.get(host_name)
        if child is None or child.log_path is None or not child.log_path.exists():
            return ""
        return child.log_path.read_text(errors="replace")[-tail:]

    def start_1p1d(self, prefill: dict, decode: dict, gateway: dict, timeout: float = 180) -> None:
        """Prefill on b, decode on c, the gateway on a; back once the gateway knows both
        workers. A service that dies on the way fails it, with the end of its log."""
        self.start_service("b", prefill)
        self.start_service("c", decode)
        self.start_service("a", gateway)
        deadline = time.monotonic() + timeout
        while set(worker_blocks(self.base_url)) != set(WORKER_IDS.values()):
            for host, child in self.children.items():
                if not child.alive():
                    raise RuntimeError(f"{child.name} died:\n{self.log(host)}")
            if time.monotonic() > deadline:
                raise TimeoutError("the multi-host stack did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop every service (printing the log of any that had died), then the cluster."""
        for host, child in self.children.items():
            if not child.alive():
                print(f"{child.name} exited:\n{self.log(host)}")
        stop_all(list(self.children.values()))
        self.cluster.stop()


@contextmanager
def namespace_stack(
    logs: Path, prefill: dict, decode: dict, gateway: dict
) -> Iterator[MultiHostStack]:
    """The three namespace hosts, their NATS cluster and a 1P1D stack on them
    (``start_1p1d``), all removed afterwards: the benchmarks' way onto the hosts (the tests
    build the same from fixtures, tests/multihost/conftest.py)."""
    topo = netns.new_topology()
    try:
        netns.build(list(ROLES), topo)
        stack = MultiHostStack(topo, cluster_on(topo, logs), logs)
        stack.cluster.start(timeout=30)
        try:
            stack.start_1p1d(prefill, decode, gateway)
            yield stack
        finally:
            stack.stop()
    finally:
        problems = topo.teardown()
        if problems:
            print("teardown problems:", problems)
