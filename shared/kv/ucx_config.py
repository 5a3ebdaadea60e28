"""Where UCX may listen: the TCP transport on one interface (``--ucx-host``) and, optionally, one
port (``--ucx-port``).

KV transfer connects by UCX worker address, never through a sockaddr listener (ucxx's listener
always binds the wildcard address). What then listens for TCP is UCX's TCP transport, once per
network device it uses; ``UCX_NET_DEVICES`` picks those devices and ``UCX_TCP_PORT_RANGE`` their
port. UCX reads both when its context is created, so ``configure`` must run before this process
makes its first ucxx call. RDMA devices (``/sys/class/infiniband``) stay enabled: they open no
IP socket, and dropping them would cost a GPU cluster its fast path.

A user's own ``UCX_NET_DEVICES`` / ``UCX_TCP_PORT_RANGE`` win over the flags.

ucxx is also set to progress in ``blocking`` mode (``UCXPY_PROGRESS_MODE``): the event loop
waits on UCX's own file descriptor instead of a progress thread handing every completion over. On 2 cores that doubled a 1 MiB pull's bandwidth (0.45 -> 1.1 GB/s,
``perf/kv_bench.py``); ``polling`` was as fast but keeps a core busy, which a worker's engine
needs. ucxx's own ``blocking`` mode never re-arms the worker and spins once UCX has seen an
event; ``pdserve.shared.kv.ucx_progress`` replaces it with one that does.

Shared memory between workers on one host (issue 29). ucxx creates every endpoint with peer
error handling (``UCP_ERR_HANDLING_MODE_PEER``), so that a dead peer fails the pull instead of
hanging it. UCX then only selects transports that advertise peer-failure support, and its
shared-memory ones (posix, sysv) advertise it only when ``UCX_MM_ERROR_HANDLING=y`` (default
``n``; their endpoints detect a dead peer by its pid, UCX's keepalive). CMA has the flag, but
rendezvous with error handling also wants memory invalidation, which CMA lacks, and it moves no
active messages. So nothing intra-node qualified and UCX took ``tcp/lo`` for every size, with
sysv/posix/cma open and ``/dev/shm`` fine (``UCX_PROTO_INFO=y``: "intra-node ... tcp/lo";
``UCX_TLS=sm,self``: "posix/memory - no peer failure handler"; ``ucx_perftest -e`` does the
same, without ``-e`` it picks sysv + cma). ``configure`` sets ``UCX_MM_ERROR_HANDLING=y``:
pulls between two processes of one host go over shared memory, ``tcp`` still carries them
between hosts, and a user's ``UCX_MM_/POSIX_/SYSV_ERROR_HANDLING`` or ``UCX_TLS=^sm`` wins.
Over shared memory no socket breaks when a peer dies: UCX's keepalive finds it gone (its pid's
start time changed) once per ``UCX_KEEPALIVE_INTERVAL``, 20 s by default, and a pull from a
killed prefill worker hung that long. 1 s (``KEEPALIVE_INTERVAL``, unless the user set one)
fails it within ~2 s; a stopped but living peer is not failed by it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

from pdserve.shared.kv import ucx_progress

log = logging.getLogger(__name__)

ALL_INTERFACES = ("", "0.0.0.0", "*")
_VARIABLES = (
    "UCX_NET_DEVICES",
    "UCX_TCP_PORT_RANGE",
    "UCXPY_PROGRESS_MODE",
    "UCX_MM_ERROR_HANDLING",
    "UCX_KEEPALIVE_INTERVAL",
)
KEEPALIVE_INTERVAL = "1s"
# Any of these set by the user decides whether shared memory may carry error-handled endpoints
# (UCX reads UCX_POSIX_/UCX_SYSV_ before the UCX_MM_ they inherit from).
SHM_ERROR_HANDLING = (
    "UCX_MM_ERROR_HANDLING",
    "UCX_POSIX_ERROR_HANDLING",
    "UCX_SYSV_ERROR_HANDLING",
)
_SIOCGIFADDR = 0x8915
_applied: dict[str, str] | None = None


class UCXConfigError(ValueError):
    """``--ucx-host`` names no interface of this machine."""


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each network interface that has one, by interface name."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # no IPv4 address on this one
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
    return out


def interface_for(host: str) -> str | None:
    """The interface holding ``host``'s address; None for "every interface"."""
    if host in ALL_INTERFACES:
        return None
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, UnicodeError) as exc:
        raise UCXConfigError(f"--ucx-host {host!r} does not resolve: {exc}") from None
    addresses = {name: ipaddress.ip_address(a) for name, a in interface_addresses().items()}
    for name, addr in addresses.items():
        # 127.0.0.0/8 is all on the loopback device, whatever single address it reports
        if addr == ip or (ip.is_loopback and addr.is_loopback):
            return name
    known = ", ".join(f"{n}={a}" for n, a in sorted(addresses.items())) or "none"
    raise UCXConfigError(
        f"--ucx-host {host!r} ({ip}) is not an address of this machine (interfaces: {known}); "
        "give this host's own address, or 0.0.0.0 for every interface"
    )


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """UCX names (``mlx5_0:1``) of the RDMA ports on this machine."""
    if not root.is_dir():
        return []
    return sorted(
        f"{dev.name}:{port.name}" for dev in root.iterdir() for port in (dev / "ports").glob("*")
    )


def ucx_environment(host: str, port: int = 0) -> dict[str, str]:
    """The UCX variables that keep its TCP listening sockets on ``host`` (and ``port``)."""
    env: dict[str, str] = {}
    device = interface_for(host)
    if device is not None:
        env["UCX_NET_DEVICES"] = ",".join([device, *rdma_devices()])
    if port:
        env["UCX_TCP_PORT_RANGE"] = f"{port}-{port}"
    return env


def shm_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What lets UCX pick shared memory between two processes of this host, and notice soon
    that such a peer died (see the module docstring). A variable the user set is theirs: any
    of ``SHM_ERROR_HANDLING`` decides the first, ``UCX_KEEPALIVE_INTERVAL`` the second."""
    env: dict[str, str] = {}
    if not any(k in environ for k in SHM_ERROR_HANDLING):
        env["UCX_MM_ERROR_HANDLING"] = "y"
    if "UCX_KEEPALIVE_INTERVAL" not in environ:
        env["UCX_KEEPALIVE_INTERVAL"] = KEEPALIVE_INTERVAL
    return env


def warn_if_link_local(host: str) -> bool:
    """UCX's TCP transport skips interfaces whose address is link-local (169.254.0.0/16,
    fe80::/10; hard-coded in ucs_netif_get_addr as of UCX 1.21), so KV pulls through such an
    address fail: say so at start-up, where it can be fixed, not at the first pull."""
    try:
        link_local = ipaddress.ip_address(host).is_link_local
    except ValueError:  # a host name or an interface: nothing to tell
        return False
    if link_local:
        log.warning(
            "--ucx-host %s is link-local: UCX's TCP transport ignores such interfaces, so KV "
            "pulls to or from this worker will fail (give it a routable address)",
            host,
        )
    return link_local


def drop_stale_memtype_cache(set_by_user: bool) -> None:
    """Importing ucxx sets ``UCX_MEMTYPE_CACHE=n`` unless it is set. UCX 1.12 and newer never
    read that variable and warn at start-up that it is unused, once per worker process, which
    reads as a misconfiguration. UCX reads its variables only when ucxx creates its context, so
    removing ucxx's default before then is enough; a value the user set is theirs to keep."""
    import ucxx

    if not set_by_user and tuple(ucxx.get_ucx_version()) >= (1, 12):
        os.environ.pop("UCX_MEMTYPE_CACHE", None)


def configure(host: str, port: int = 0) -> dict[str, str]:
    """Set this process's UCX variables for ``host``/``port``; returns what is in force.

    Runs once per process: UCX has read its variables by the time a second caller (a test
    with both transfer ends in one process) comes, so that one is only told what holds.
    """
    global _applied
    wanted = ucx_environment(host, port)
    if _applied is None:
        warn_if_link_local(host)
        mode = os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
        if mode != "blocking":
            log.warning("UCXPY_PROGRESS_MODE=%s ignored: KV transfer needs blocking mode", mode)
        os.environ["UCXPY_PROGRESS_MODE"] = "blocking"
        os.environ.update(shm_environment())
        for key, value in wanted.items():
            if key in os.environ and os.environ[key] != value:
                log.info("%s=%s from the environment wins over %s", key, os.environ[key], value)
            else:
                os.environ[key] = value
        _applied = {k: os.environ[k] for k in _VARIABLES if k in os.environ}
        users_memtype_cache = "UCX_MEMTYPE_CACHE" in os.environ
        ucx_progress.install()  # imports ucxx
        drop_stale_memtype_cache(users_memtype_cache)
        port_range = _applied.get("UCX_TCP_PORT_RANGE")
        log.info(
            "UCX TCP transport listens on %s%s; ucxx progress: %s",
            _applied.get("UCX_NET_DEVICES", "every interface"),
            f" port {port_range}" if port_range else "",
            _applied["UCXPY_PROGRESS_MODE"],
        )
    elif any(_applied.get(k) != v for k, v in wanted.items()):
        log.warning("UCX is already configured (%s); ignoring %s", _applied, wanted)
    return dict(_applied)
