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

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.services.launcher import service_argv
from pdserve.services.processes import Child, NatsCluster, NatsServer, spawn
from pdserve.shared.options import service_env
from tests.integration.stack import QUIET_ENV
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
