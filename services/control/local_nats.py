"""The bus ``pdserve up`` runs on: the user's own NATS (``--nats-url``), one private nats-server,
or with ``--nats-cluster N`` N nodes routed to each other on loopback.

The cluster is a way to try one, and to watch a node die: each worker connects to node
``slot % N`` first and lists the others for failover (``client_url``), and the launcher keeps
serving while at least one node lives (``lost``). It lives apart from the launcher because it is
a thing of its own, started first, watched while serving, stopped last (draining needs it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pdserve.services.control.processes import NatsCluster, NatsServer
from pdserve.shared.config import BusConfig, UpConfig

MAX_CLUSTER_NODES = 9


class LocalNats:
    def __init__(self, up: UpConfig, bus: BusConfig) -> None:
        self.up = up
        self.bus = bus
        self.server: NatsServer | None = None
        self.cluster: NatsCluster | None = None

    def start(self, avoid: frozenset[int]) -> str:
        """Start what the flags ask for (nothing with ``--nats-url``), on ports outside
        ``avoid``; returns the URL that clients connect to."""
        if self.up.nats_url:
            return self.up.nats_url
        if self.up.nats_cluster > 1:
            self.cluster = self._start_cluster(avoid)
            return self.cluster.url
        self.server = NatsServer(
            max_payload=self.bus.max_message_bytes,
            token=self.bus.nats_token,
            user=self.bus.nats_user,
            password=self.bus.nats_password,
            avoid_ports=avoid,
        )
        # its chatter goes to a file; the services' logs stay readable on the terminal
        self.server.log_path = self.server.workdir / "nats-server.log"
        self.server.start()
        return self.server.url

    def _start_cluster(self, avoid: frozenset[int]) -> NatsCluster:
        if self.up.nats_cluster > MAX_CLUSTER_NODES:
            raise SystemExit(f"pdserve up: --nats-cluster takes 1 to {MAX_CLUSTER_NODES} nodes")
        workdir = Path(tempfile.mkdtemp(prefix="pdserve-nats-cluster-"))
        cluster = NatsCluster.local(
            self.up.nats_cluster,
            workdir,
            max_payload=self.bus.max_message_bytes,
            token=self.bus.nats_token,
            user=self.bus.nats_user,
            password=self.bus.nats_password,
            avoid_ports=avoid,
        )
        cluster.start()
        return cluster

    def client_url(self, slot: int) -> str | None:
        """The URL of the worker started ``slot``-th: in a cluster, its own node first and the
        others after it, so the workers spread over the nodes (None: the one URL of all)."""
        return self.cluster.client_url(slot) if self.cluster is not None else None

    def lost(self, reported: set[int]) -> str | None:
        """Why the stack has no bus any more (None: it has one). Each cluster node that died is
        reported once, its pid added to ``reported``."""
        if self.server is not None and self.server.child and not self.server.child.alive():
            return "nats-server exited"
        if self.cluster is None:
            return None
        alive = 0
        for node in self.cluster.nodes:
            if node.child is None:
                continue
            if node.child.alive():
                alive += 1
            elif node.child.pid not in reported:
                reported.add(node.child.pid)
                code = node.child.popen.returncode
                print(f"pdserve: NATS {node.server_name} exited with {code}", file=sys.stderr)
        return "every NATS node exited" if alive == 0 else None

    def banner(self) -> str:
        if self.cluster is not None:
            nodes = self.cluster.nodes
            return f"nats: cluster of {len(nodes)} at {self.cluster.url}, logs in " + str(
                nodes[0].workdir
            )
        if self.server is not None:
            return f"nats: {self.server.url}, log {self.server.log_path}"
        return f"nats: {self.up.nats_url}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.cluster is not None:
            self.cluster.stop()
