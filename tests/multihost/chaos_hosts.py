"""``ChaosStack`` spread over the namespace "hosts" of ``netns.py``, so that a worker's network
link can really go down (``perf/chaos_bench.py``'s partition faults, #47):

    host a: NATS node-1, the gateway, p0, d0
    host b: NATS node-2, d1          (partition_decode unplugs it)
    host c: NATS node-3, p1          (partition_prefill unplugs it)

As in ``hosts.py``, the three nodes form one cluster over the hosts' 198.18 addresses, but every
process here connects to its own host's node alone, as to a node-local bus, and the nodes do
not advertise each other to clients (``no_advertise``): with the others listed or announced for
failover, host a's processes moved to node 2 when the NATS-restart fault took node 1 down, and
stayed there, so that unplugging host b later cut off the gateway and d0 too, not d1 alone
(seen in two runs: every request failed until the link was back). Workers
bind KV transfer to their host's 198.18 address (``--ucx-host``, UCX's shared-memory transports off),
and the driver in the root namespace reaches the gateway's HTTP (and the nodes' monitor ports)
over the link-local management addresses only. ``nats`` (the node a NATS-restart fault restarts)
is host a's node. ``stop`` tears the namespaces down with everything in them.

Needs root and ``ip netns`` (``netns.unavailable_reason``).
"""

from __future__ import annotations

import sys

from pdserve.services.control.launcher import service_argv
from pdserve.services.control.processes import Child, NatsCluster, spawn
from pdserve.shared.options import service_env
from tests.integration.chaos_stack import ChaosStack
from tests.integration.stack import QUIET_ENV, stop_all
from tests.multihost import netns
from tests.multihost.hosts import GATEWAY_PORT, cluster_on

HOSTS = ("a", "b", "c")
PLACEMENT = {"p0": "a", "d0": "a", "d1": "b", "p1": "c"}  # a worker not named here runs on a


class NetnsChaosStack(ChaosStack):
    """A ``ChaosStack`` whose processes run on namespace hosts; ``partition`` unplugs one."""

    def __init__(self, *args, placement: dict[str, str] | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.placement = {**PLACEMENT, **(placement or {})}
        self.topo = netns.new_topology()
        self.cluster: NatsCluster | None = None

    def host_of(self, worker: str) -> str:
        return self.placement.get(worker, "a")

    def start(self) -> None:
        netns.build(list(HOSTS), self.topo)
        self.cluster = cluster_on(self.topo, self.logs)
        for node in self.cluster.nodes:  # a host-local bus: nobody wanders to another host's
            node.no_advertise = True
        self.cluster.start(timeout=30)
        self.nats = self.cluster.nodes[0]
        for name in self.roles:
            self.start_worker(name)
        a = self.topo.hosts["a"]
        # HTTP for the driver alone, on the usual port: each namespace has its own ports
        options = {
            **self.gateway_options,
            "model": self.model,
            "host": a.mgmt,
            "port": GATEWAY_PORT,
        }
        self.children["gw"] = self._spawn("gw", "a", service_argv("gateway"), options, {})
        self.base = f"http://{a.mgmt}:{GATEWAY_PORT}"

    def start_worker(self, name: str, options: dict[str, object] | None = None) -> None:
        host = self.topo.hosts[self.host_of(name)]
        values = {
            **self.worker_options,
            **(options or {}),
            "model": self.model,
            "worker_id": name,
            "ucx_host": host.address,  # KV only over the bridge
        }
        argv = [sys.executable, "-m", "tests.integration.staged_worker", self.roles[name]]
        env = {"STAGE_GATES": str(self.gates)}
        self.children[name] = self._spawn(name, host.name, argv, values, env)

    def _spawn(
        self, name: str, host_name: str, argv: list[str], options: dict, env: dict[str, str]
    ) -> Child:
        assert self.cluster is not None
        host = self.topo.hosts[host_name]
        node = self.cluster.nodes[HOSTS.index(host_name)]
        values = {"nats_url": node.url, **options}
        base = {**netns.inherited_env(), **QUIET_ENV, **env}
        full_env = service_env(values, base)
        return spawn(name, host.argv(*argv), full_env, self.logs / f"{name}.log")

    def partition(self, worker: str, down: bool) -> None:
        """Unplug (``down``) or plug back the cable of ``worker``'s host; host a, which holds
        the gateway, is never unplugged (the driver would lose the stack, not a worker)."""
        host = self.host_of(worker)
        assert host != "a", f"{worker} shares host a with the gateway"
        self.topo.link(host, up=not down)

    def stop(self) -> None:
        try:
            stop_all(list(self.children.values()))
            if self.cluster is not None:
                self.cluster.stop()
        finally:
            problems = self.topo.teardown()
            if problems:
                print("netns teardown problems:", problems, file=sys.stderr)
