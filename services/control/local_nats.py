"""The bus ``pdserve up`` runs on: the user's own NATS (``--nats-url``), one private nats-server,
or with ``--nats-cluster N`` N nodes routed to each other on loopback.

The cluster is a way to try one, and to watch a node die: each worker connects to node
``slot % N`` first and lists the others for failover (``client_url``), and the launcher keeps
serving while at least one node lives (``lost``). It lives apart from the launcher because it is
a thing of its own, started first, watched while serving, stopped last (draining needs it).

What pdserve starts runs JetStream, where the gateway keeps stored responses (``/v1/responses``),
in a store under pdserve's cache directory (``PDSERVE_CACHE_DIR``, default ~/.cache/pdserve):
``nats/jetstream``, or ``nats/cluster-N/node-I`` for a cluster's nodes, so stored responses
outlive a restart of the stack. nats-server does not lock its store, and two servers writing one
would corrupt it, so ``StoreDir`` does: a second ``pdserve up`` on the machine gets a temporary
store, and says so.

Unless the user brought credentials (``--nats-token``, ``--nats-user``, ``--nats-creds``), the
NATS that pdserve starts has one user per role (shared/bus/roles.py) with a password made for
this run: each process gets its own role's (``credentials``), so a worker's cannot send what
only a gateway may. The control role's (``pdserve rollout``, ``pdserve doctor``) is written to
``control.env`` beside the server's config, readable by this user alone.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from pathlib import Path

from pdserve.services.control.processes import NatsCluster, NatsServer
from pdserve.shared.bus.roles import authorization_block, new_passwords
from pdserve.shared.config import BusConfig, UpConfig
from pdserve.shared.models.demo import cache_dir

MAX_CLUSTER_NODES = 9


class StoreDir:
    """A JetStream store under the cache directory, held by this process while it runs."""

    def __init__(self, name: str) -> None:
        self.base = cache_dir() / "nats" / name
        self.path: Path | None = None
        self.temporary = False
        self._lock: int | None = None

    def acquire(self) -> Path:
        self.base.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.base / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when this process ends
        except BlockingIOError:
            os.close(fd)
            self.path, self.temporary = Path(tempfile.mkdtemp(prefix="pdserve-jetstream-")), True
            return self.path
        self._lock, self.path = fd, self.base / "store"
        return self.path

    def describe(self) -> str:
        if self.temporary:
            return f"JetStream in {self.path} (temporary: {self.base} is another stack's)"
        return f"JetStream in {self.path}"

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


class LocalNats:
    def __init__(self, up: UpConfig, bus: BusConfig) -> None:
        self.up = up
        self.bus = bus
        self.server: NatsServer | None = None
        self.cluster: NatsCluster | None = None
        self.store: StoreDir | None = None
        # role -> password; None: the user's own credentials (or none) for every process
        self.passwords: dict[str, str] | None = None
        self.control_env: Path | None = None

    def _roles(self) -> str:
        """The authorization block of a bus with per-role users ("" when the user brought
        credentials of their own, which then serve every process as before)."""
        if self.bus.nats_token or self.bus.nats_user or self.bus.nats_creds:
            return ""
        self.passwords = new_passwords()
        return authorization_block(self.bus.namespace, self.passwords)

    def credentials(self, role: str) -> dict[str, str]:
        """The options that make a process of ``role`` log in as its role ({} without roles)."""
        if self.passwords is None:
            return {}
        return {"nats_user": role, "nats_password": self.passwords[role]}

    def _write_control_env(self, workdir: Path, url: str) -> None:
        if self.passwords is None:
            return
        self.control_env = workdir / "control.env"
        fd = os.open(self.control_env, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(
                f"PDSERVE_NATS_URL={url}\nPDSERVE_NATS_USER=control\n"
                f"PDSERVE_NATS_PASSWORD={self.passwords['control']}\n"
            )

    def start(self, avoid: frozenset[int]) -> str:
        """Start what the flags ask for (nothing with ``--nats-url``), on ports outside
        ``avoid``; returns the URL that clients connect to."""
        if self.up.nats_url:
            return self.up.nats_url
        if self.up.nats_cluster > 1:
            self.store = StoreDir(f"cluster-{self.up.nats_cluster}")
            self.cluster = self._start_cluster(avoid, self.store.acquire())
            self._write_control_env(self.cluster.nodes[0].workdir, self.cluster.url)
            return self.cluster.url
        self.store = StoreDir("jetstream")
        self.server = NatsServer(
            max_payload=self.bus.max_message_bytes,
            token=self.bus.nats_token,
            user=self.bus.nats_user,
            password=self.bus.nats_password,
            avoid_ports=avoid,
            jetstream_dir=self.store.acquire(),
            authorization=self._roles(),
        )
        # its chatter goes to a file; the services' logs stay readable on the terminal
        self.server.log_path = self.server.workdir / "nats-server.log"
        self.server.start()
        self._write_control_env(self.server.workdir, self.server.url)
        return self.server.url

    def _start_cluster(self, avoid: frozenset[int], jetstream: Path) -> NatsCluster:
        if self.up.nats_cluster > MAX_CLUSTER_NODES:
            raise SystemExit(f"pdserve up: --nats-cluster takes 1 to {MAX_CLUSTER_NODES} nodes")
        workdir = Path(tempfile.mkdtemp(prefix="pdserve-nats-cluster-"))
        cluster = NatsCluster.local(
            self.up.nats_cluster,
            workdir,
            jetstream,
            max_payload=self.bus.max_message_bytes,
            token=self.bus.nats_token,
            user=self.bus.nats_user,
            password=self.bus.nats_password,
            avoid_ports=avoid,
            authorization=self._roles(),
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
        store = f", {self.store.describe()}" if self.store is not None else ""
        if self.control_env is not None:
            store += f", a user per role (control's in {self.control_env})"
        if self.cluster is not None:
            nodes = self.cluster.nodes
            return (
                f"nats: cluster of {len(nodes)} at {self.cluster.url}, logs in "
                + str(nodes[0].workdir)
                + store
            )
        if self.server is not None:
            return f"nats: {self.server.url}, log {self.server.log_path}{store}"
        return f"nats: {self.up.nats_url}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.store is not None:
            self.store.release()
