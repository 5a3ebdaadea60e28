"""Three "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

Each host is a namespace with one interface (``eth0``) holding a link-local address
169.254.S.H/24 (S picked per run, H = 11, 12, ...); the bridge in the root namespace holds
169.254.S.1, so the test process reaches every host and the hosts reach each other only through
the bridge, as separate machines on one switch would. Only link-local addresses are used:
traffic to private or public ranges is flagged on these machines even when it stays inside.

Names start with a per-run prefix (``pdm`` + 5 random hex digits) so parallel runs cannot
collide, and ``Topology.teardown`` removes everything a run made - the processes left in its
namespaces (by pid), the namespaces (their veth ends go with them), the bridge and the firewall
rule - whatever state a failed test left behind.
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
# third octets never used: docker's bridge and pools here (77, 80-95), the cloud metadata /24
_AVOID_SUBNETS = {77, 169, *range(80, 96)}


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


def _free_subnet() -> int:
    """A third octet of 169.254.S.0/24 no route of this machine uses."""
    routes = ip("-4", "route", "show", "table", "all").stdout
    used = set()
    for word in routes.split():
        with contextlib.suppress(ValueError):
            net = ipaddress.ip_network(word, strict=False)
            if net.subnet_of(LINK_LOCAL) or LINK_LOCAL.subnet_of(net):
                used.add(int(net.network_address.packed[2]))
    choices = [s for s in range(128, 251) if s not in used and s not in _AVOID_SUBNETS]
    if not choices:
        raise TopologyError("no free 169.254.x.0/24 subnet")
    return random.choice(choices)


@dataclass
class Host:
    name: str  # "a", "b", ...
    netns: str
    address: str
    veth: str  # its end in the root namespace, on the bridge

    def argv(self, *argv: str) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        out = ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]


@dataclass
class Topology:
    prefix: str
    bridge: str
    subnet: int
    hosts: dict[str, Host] = field(default_factory=dict)
    firewall_rule: list[str] | None = None

    @property
    def bridge_address(self) -> str:
        return f"169.254.{self.subnet}.1"

    def link(self, host: str, up: bool) -> None:
        """Unplug (or plug back) ``host``'s cable: its veth end on the bridge goes down."""
        ip("link", "set", self.hosts[host].veth, "up" if up else "down")

    def teardown(self) -> list[str]:
        """Remove everything, best effort; returns what could not be removed."""
        problems = []
        for host in self.hosts.values():
            _kill(host.pids())
        for host in self.hosts.values():
            done = ip("netns", "del", host.netns, check=False)
            if done.returncode != 0 and Path(f"/run/netns/{host.netns}").exists():
                problems.append(f"netns {host.netns}: {done.stderr.strip()}")
            # deleting the namespace deletes the pair; this covers a half-built host
            ip("link", "del", host.veth, check=False)
        ip("link", "del", self.bridge, check=False)
        if ip("link", "show", self.bridge, check=False).returncode == 0:
            problems.append(f"bridge {self.bridge} still exists")
        if self.firewall_rule:
            subprocess.run(["iptables", "-D", *self.firewall_rule], capture_output=True)
            self.firewall_rule = None
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run that still exist (empty after teardown)."""
        names = ip("netns", "list", check=False).stdout + ip("-o", "link", check=False).stdout
        return sorted({w.rstrip(":@") for w in names.split() if w.startswith(self.prefix)})


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        time.sleep(0.05)


def build(host_names: list[str], topo: Topology | None = None) -> Topology:
    """Make the bridge and one namespace per host name. On a failure part-way the caller still
    tears down what was made: pass ``topo`` in (from ``new_topology``) to keep a handle on it."""
    topo = topo or new_topology()
    ip("link", "add", topo.bridge, "type", "bridge")
    ip("addr", "add", f"{topo.bridge_address}/24", "dev", topo.bridge)
    ip("link", "set", topo.bridge, "up")
    _allow_bridged_traffic(topo)
    for i, name in enumerate(host_names):
        host = Host(
            name=name,
            netns=f"{topo.prefix}-{name}",
            address=f"169.254.{topo.subnet}.{11 + i}",
            veth=f"{topo.prefix}{name}",
        )
        topo.hosts[name] = host
        inner = f"{topo.prefix}{name}i"
        ip("netns", "add", host.netns)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", host.netns)
        ip("link", "set", host.veth, "master", topo.bridge)
        ip("link", "set", host.veth, "up")
        ns = ("-n", host.netns)
        ip(*ns, "link", "set", inner, "name", "eth0")
        ip(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip(*ns, "link", "set", "eth0", "up")
        ip(*ns, "link", "set", "lo", "up")
    return topo


def new_topology() -> Topology:
    prefix = "pdm" + secrets.token_hex(3)[:5]
    return Topology(prefix=prefix, bridge=f"{prefix}br", subnet=_free_subnet())


def _allow_bridged_traffic(topo: Topology) -> None:
    """With br_netfilter loaded (dockerd loads it) bridged frames cross iptables' FORWARD
    chain, whose policy docker sets to DROP: let this bridge's own traffic through."""
    knob = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if not knob.exists() or knob.read_text().strip() != "1" or shutil.which("iptables") is None:
        return
    rule = ["FORWARD", "-i", topo.bridge, "-o", topo.bridge, "-j", "ACCEPT"]
    if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode == 0:
        topo.firewall_rule = rule
