"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge that sits
in a namespace of its own, as separate machines on one switch.

Addresses (S picked per run, H = 11, 12, ... per host):

- **198.18.S.H/24**, the host's address on the network (``Host.address``): everything between
  hosts uses it - NATS client connections and routes, KV transfer (``--ucx-host``), the
  doctor's probes. 198.18.0.0/15 is the range set aside for benchmarking networks (RFC 2544):
  UCX's TCP transport uses it, where it skips link-local interfaces. The root namespace has no
  route to it and holds no address in it, so nothing here can send to it except the hosts.
- **169.254.S.H/24**, beside it on the same ``eth0`` (``Host.mgmt``): only for the test driver
  in the root namespace, which reaches it through one uplink veth on the bridge holding
  169.254.S.1 (the gateway's HTTP, a NATS node's monitor port).

No other range is used: traffic towards private or public ranges is flagged on these machines
even when it stays inside. The network address is added first, so it is the interface's primary
address (what ``SIOCGIFADDR``, and so ``--ucx-host`` checking, reads).

Names start with a per-run prefix (``pdm`` + 5 random hex digits) so parallel runs cannot
collide; each veth end is made directly inside its namespace, so the only link in the root
namespace is the uplink. ``Topology.teardown`` removes everything a run made - the processes
left in its namespaces (by pid), the namespaces (their veth ends and the bridge go with them)
and the uplink - whatever state a failed test left behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
# third octets never used: docker's bridge and pools here (77, 80-95), the cloud metadata /24
_AVOID_SUBNETS = {77, 169, *range(80, 96)}
# Namespaces on one machine share its memory, and UCX sees it (one boot id, one IPC and PID
# namespace): between two of them it picks sysv/cma, as between two processes of one host, and
# KV would never touch the bridge. Hosts share no memory, so every process started on one runs
# with UCX's shared-memory transports off; TCP (and RDMA, CUDA) stay as configured.
HOST_ENV = {"UCX_TLS": "^sm"}


def inherited_env() -> dict[str, str]:
    """This process's environment as a host's processes start from it: without ``PDSERVE_*``
    settings and without UCX's. An in-process KV test earlier in the session leaves
    ``ucx_config.configure``'s choices in ``os.environ`` (``UCX_NET_DEVICES=lo`` among them),
    and a user's UCX variables win over pdserve's flags: inherited, they would pin every host
    to the loopback device, and no pull could leave it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "UCX_", "UCXPY_"))}


class TopologyError(RuntimeError):
    """A command building the topology failed."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise TopologyError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"pdmprobe{secrets.token_hex(3)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _networks(text: str) -> list[ipaddress.IPv4Network]:
    out = []
    for word in text.split():
        with contextlib.suppress(ValueError):
            net = ipaddress.ip_network(word, strict=False)
            if net.version == 4 and net.prefixlen > 0:  # "default" and 0.0.0.0/0 say nothing
                out.append(net)
    return out


def root_routes_into(network: ipaddress.IPv4Network) -> list[str]:
    """Routes and addresses of the root namespace that overlap ``network`` (the default route
    aside): empty when this namespace cannot reach it except through its default gateway."""
    text = ip("-4", "route", "show", "table", "all").stdout + ip("-4", "addr").stdout
    return sorted({str(n) for n in _networks(text) if n.overlaps(network)})


def _free_subnet() -> int:
    """A third octet S such that no route of this machine touches 169.254.S.0/24 or
    198.18.S.0/24 (a container runtime here may hold a 198.18 network of its own)."""
    routes = ip("-4", "route", "show", "table", "all").stdout
    used = set()
    for net in _networks(routes):
        for mine in (LINK_LOCAL, BENCHMARK_RANGE):
            if net.subnet_of(mine) and net.prefixlen >= 16:
                used.update(
                    range(
                        int(net.network_address.packed[2]), int(net.broadcast_address.packed[2]) + 1
                    )
                )
            elif mine.subnet_of(net):
                used.update(range(256))
    choices = [s for s in range(128, 251) if s not in used and s not in _AVOID_SUBNETS]
    if not choices:
        raise TopologyError("no free 169.254.x.0/24 subnet")
    return random.choice(choices)


@dataclass
class Host:
    name: str  # "a", "b", ...
    netns: str
    address: str  # 198.18.S.H: between hosts
    mgmt: str  # 169.254.S.H: the test driver's way in, and nothing else
    veth: str  # its end on the bridge, in the bridge's namespace

    def argv(self, *argv: str) -> list[str]:
        """``argv`` run inside this host, with ``HOST_ENV`` (``ip netns exec`` and ``env`` exec
        it: same pid)."""
        return ["ip", "netns", "exec", self.netns, "env", *_assignments(HOST_ENV), *argv]

    def pids(self) -> list[int]:
        out = ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]


@dataclass
class Topology:
    prefix: str
    subnet: int
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge_netns(self) -> str:
        return f"{self.prefix}-switch"

    @property
    def uplink(self) -> str:
        """The root namespace's veth end on the bridge: the driver's only link."""
        return f"{self.prefix}up"

    @property
    def uplink_address(self) -> str:
        return f"169.254.{self.subnet}.1"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"198.18.{self.subnet}.0/24")

    def link(self, host: str, up: bool) -> None:
        """Unplug (or plug back) ``host``'s cable: its veth end on the bridge goes down."""
        ip("-n", self.bridge_netns, "link", "set", self.hosts[host].veth, "up" if up else "down")

    def teardown(self) -> list[str]:
        """Remove everything, best effort; returns what could not be removed."""
        problems = []
        for host in self.hosts.values():
            _kill(host.pids())
        for netns in [h.netns for h in self.hosts.values()] + [self.bridge_netns]:
            done = ip("netns", "del", netns, check=False)
            if done.returncode != 0 and Path(f"/run/netns/{netns}").exists():
                problems.append(f"netns {netns}: {done.stderr.strip()}")
        # deleting the bridge's namespace deletes the pair; this covers a half-built uplink
        ip("link", "del", self.uplink, check=False)
        if ip("link", "show", self.uplink, check=False).returncode == 0:
            problems.append(f"uplink {self.uplink} still exists")
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run that still exist (empty after teardown)."""
        names = ip("netns", "list", check=False).stdout + ip("-o", "link", check=False).stdout
        return sorted({w.rstrip(":@") for w in names.split() if w.startswith(self.prefix)})


def _assignments(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        time.sleep(0.05)


def build(host_names: list[str], topo: Topology | None = None) -> Topology:
    """Make the bridge's namespace, the uplink and one namespace per host name. On a failure
    part-way the caller still tears down what was made: pass ``topo`` in (from
    ``new_topology``) to keep a handle on it."""
    topo = topo or new_topology()
    sw = topo.bridge_netns
    ip("netns", "add", sw)
    ip("-n", sw, "link", "add", "br0", "type", "bridge")
    ip("-n", sw, "link", "set", "br0", "up")
    ip("link", "add", topo.uplink, "type", "veth", "peer", "name", "uplink", "netns", sw)
    _plug(sw, "uplink")
    ip("addr", "add", f"{topo.uplink_address}/24", "dev", topo.uplink)
    ip("link", "set", topo.uplink, "up")
    for i, name in enumerate(host_names):
        host = Host(
            name=name,
            netns=f"{topo.prefix}-{name}",
            address=f"198.18.{topo.subnet}.{11 + i}",
            mgmt=f"169.254.{topo.subnet}.{11 + i}",
            veth=f"to-{name}",
        )
        topo.hosts[name] = host
        ip("netns", "add", host.netns)
        ip(
            "-n",
            sw,
            "link",
            "add",
            host.veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.netns,
        )
        _plug(sw, host.veth)
        ns = ("-n", host.netns)
        ip(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")  # first: the primary
        ip(*ns, "addr", "add", f"{host.mgmt}/24", "dev", "eth0")
        ip(*ns, "link", "set", "eth0", "up")
        ip(*ns, "link", "set", "lo", "up")
    return topo


def _plug(bridge_netns: str, veth: str) -> None:
    ip("-n", bridge_netns, "link", "set", veth, "master", "br0")
    ip("-n", bridge_netns, "link", "set", veth, "up")


def new_topology() -> Topology:
    prefix = "pdm" + secrets.token_hex(3)[:5]
    return Topology(prefix=prefix, subnet=_free_subnet())
