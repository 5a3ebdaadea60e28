"""Can UCX use this host's fast hardware? Cheap checks for worker start-up, and the facts
``pdserve doctor`` reports.

UCX never fails when it cannot use RDMA or CUDA: it quietly moves the bytes over TCP, 100x
slower (nixl#1021: 0.32 GB/s instead of 285 GB/s). The usual causes are all visible without
moving a byte:

- the UCX library was built without the transport. The ``libucx`` wheel that ``ucxx`` pulls in
  is configured ``--without-verbs``: it has no InfiniBand/RoCE support at all;
- ``UCX_TLS`` or ``UCX_NET_DEVICES`` leave the RDMA ports (or CUDA transports) out.

``transport_warnings`` turns those into one sentence each; workers log them at start-up.
Between two processes of one host the fast path is shared memory (posix/sysv/cma, cuda_ipc for
GPU memory); ``shm_blockers`` says why UCX may have taken TCP there instead (issue 29).
``ucx_facts`` is the fuller picture from inside a process that has UCX running (version, the
library file, its transport modules, the resources its context opened); ``process_transports``
is just those resources, which every rank of a worker reports for ``pdserve doctor``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.shared.kv.ucx_config import SHM_ERROR_HANDLING, rdma_devices

log = logging.getLogger(__name__)

# UCX transport names (and UCX_TLS aliases) that run over RDMA hardware, and over CUDA.
RDMA_TLS = (
    "ib",
    "rc",
    "rc_v",
    "rc_x",
    "rc_verbs",
    "rc_mlx5",
    "ud",
    "ud_v",
    "ud_x",
    "ud_verbs",
    "ud_mlx5",
    "dc",
    "dc_x",
    "dc_mlx5",
    "srd",
)
CUDA_TLS = ("cuda", "cuda_copy", "cuda_ipc", "gdr_copy")
_RESOURCE_RE = re.compile(r"^#\s+resource\s+\d+\s*:.*\s(\S+)/(\S+)\s*$", re.MULTILINE)
DOCTOR_HINT = "run `pdserve doctor` for the full transport check"
MAX_PROCESS_TRANSPORTS = 64  # resources a process reports (a host with 8 NICs has ~50)
MAX_TRANSPORT_CHARS = 64


# Transports that move bytes between processes of one host without the network stack.
SHM_TLS = ("posix", "sysv", "cma", "xpmem", "knem")
INTRA_HOST_TLS = (*SHM_TLS, "cuda_ipc", "rocm_ipc", "self")
_TRUE = ("y", "yes", "on", "1", "true")


def is_intra_host(transport: str) -> bool:
    """A shared-memory (or GPU IPC) transport: what two processes of one host should use."""
    return transport in INTRA_HOST_TLS


def is_rdma(transport: str) -> bool:
    return transport.split("_")[0] in ("rc", "ud", "dc", "srd", "ib")


def is_cuda(transport: str) -> bool:
    return transport.startswith(("cuda", "gdr"))


@dataclass
class HostDevices:
    """Fast hardware the kernel shows, whatever UCX makes of it."""

    rdma: list[str] = field(default_factory=list)  # UCX device names, e.g. mlx5_0:1
    cuda: list[str] = field(default_factory=list)  # GPU ids from the NVIDIA driver


def cuda_devices(
    proc: Path = Path("/proc/driver/nvidia/gpus"), dev: Path = Path("/dev")
) -> list[str]:
    """GPUs the NVIDIA driver exposes (read from /proc and /dev: no CUDA initialisation)."""
    if proc.is_dir():
        found = sorted(p.name for p in proc.iterdir())
        if found:
            return found
    return sorted(p.name for p in dev.glob("nvidia[0-9]*"))


def host_devices() -> HostDevices:
    return HostDevices(rdma=rdma_devices(), cuda=cuda_devices())


def loaded_ucp_library(maps: Path = Path("/proc/self/maps")) -> Path | None:
    """The libucp this process has loaded (ucxx may pick the wheel's or the system's)."""
    try:
        for line in maps.read_text().splitlines():
            path = line.split()[-1]
            if "/libucp.so" in path:
                return Path(path)
    except OSError:
        pass
    return None


def ucx_library_dir() -> Path | None:
    """Directory of the UCX libraries this process uses (or would use: the libucx wheel)."""
    found = loaded_ucp_library()
    if found is not None:
        return found.parent
    try:
        import libucx

        return Path(libucx.__file__).parent / "lib"
    except ImportError:
        return None


def uct_modules(lib_dir: Path | None) -> list[str]:
    """Transport modules UCX can load, e.g. ``["cma", "cuda", "ib"]`` (tcp, shm and self are
    built into libuct itself and always there)."""
    if lib_dir is None or not (lib_dir / "ucx").is_dir():
        return []
    names = {
        m.group(1)
        for p in (lib_dir / "ucx").glob("libuct_*.so*")
        if (m := re.match(r"libuct_(\w+?)\.so", p.name))
    }
    return sorted(names)


def _tls_allows(value: str | None, names: tuple[str, ...]) -> bool:
    """Whether a ``UCX_TLS`` value leaves any transport of ``names`` enabled.

    ``names[0]`` is the umbrella alias (``ib``, ``cuda``): an exclusion list (``^...``) turns
    the whole family off only through it, since ``^rc`` still leaves ``ud`` and ``dc`` on.
    """
    if not value:
        return True
    items = [x.strip().lower().lstrip("\\") for x in value.split(",") if x.strip()]
    if items and items[0].startswith("^"):
        return names[0] not in {items[0][1:], *items[1:]}
    return "all" in items or bool(set(items) & set(names))


def _net_devices_allow(value: str | None, rdma: list[str]) -> bool:
    if not value or value.strip().lower() == "all" or not rdma:
        return True
    chosen = {x.strip() for x in value.split(",")}
    return bool(chosen & set(rdma)) or any(d.split(":")[0] in chosen for d in rdma)


@dataclass
class Finding:
    """Hardware UCX will not use, and why."""

    kind: str  # "rdma" or "cuda"
    text: str
    deliberate: bool = False  # the user's own UCX_TLS / UCX_NET_DEVICES asked for it


def transport_findings(
    env: Mapping[str, str] | None = None,
    devices: HostDevices | None = None,
    modules: list[str] | None = None,
) -> list[Finding]:
    """Every way this host's RDMA or CUDA hardware is lost to UCX (empty: none).

    Reads only files and variables, so a worker can afford it at every start.
    """
    env = os.environ if env is None else env
    devices = host_devices() if devices is None else devices
    modules = uct_modules(ucx_library_dir()) if modules is None else modules
    out: list[Finding] = []
    if devices.rdma:
        rdma = ", ".join(devices.rdma)
        if not any(m.startswith(("ib", "rdmacm")) for m in modules):
            text = (
                f"RDMA devices present ({rdma}) but this UCX build has no InfiniBand/RoCE "
                "transport (the libucx wheel is built --without-verbs): KV transfer falls back "
                "to TCP. Install UCX with verbs and set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true"
            )
            out.append(Finding("rdma", text))
        elif not _tls_allows(env.get("UCX_TLS"), RDMA_TLS):
            text = f"RDMA devices present ({rdma}) but UCX_TLS={env['UCX_TLS']} excludes them"
            out.append(Finding("rdma", text, deliberate=True))
        elif not _net_devices_allow(env.get("UCX_NET_DEVICES"), devices.rdma):
            text = (
                f"RDMA devices present ({rdma}) but UCX_NET_DEVICES={env['UCX_NET_DEVICES']} "
                "leaves them out"
            )
            out.append(Finding("rdma", text, deliberate=True))
    if devices.cuda:
        gpus = f"{len(devices.cuda)} GPU(s)"
        if "cuda" not in modules:
            out.append(Finding("cuda", f"{gpus} present but this UCX build has no CUDA transport"))
        elif not _tls_allows(env.get("UCX_TLS"), CUDA_TLS):
            text = f"{gpus} present but UCX_TLS={env['UCX_TLS']} excludes the CUDA transports"
            out.append(Finding("cuda", text, deliberate=True))
    return out


def transport_warnings(
    env: Mapping[str, str] | None = None,
    devices: HostDevices | None = None,
    modules: list[str] | None = None,
) -> list[str]:
    """``transport_findings`` as sentences (what workers log and report to the doctor)."""
    return [f.text for f in transport_findings(env, devices, modules)]


def warn_at_startup(role: str) -> list[str]:
    """Log each transport warning for a worker that has just set up KV transfer."""
    found = transport_warnings()
    for text in found:
        log.warning("%s worker: %s; %s", role, text, DOCTOR_HINT)
    return found


def _tls_leaves_out_shm(value: str | None) -> bool:
    """Whether a ``UCX_TLS`` value turns every shared-memory transport off (``^sm``, ``tcp``)."""
    if not value:
        return False
    items = [x.strip().lower().lstrip("\\") for x in value.split(",") if x.strip()]
    if items and items[0].startswith("^"):
        off = {items[0][1:], *items[1:]}
        return bool(off & {"sm", "shm"}) or set(SHM_TLS[:3]) <= off
    return not ({"all", "sm", "shm"} | set(SHM_TLS)) & set(items)


def shm_blockers(
    env: Mapping[str, str], resources: list[str], shm_dir: Path = Path("/dev/shm")
) -> list[str]:
    """Why UCX may carry messages between two processes of this host over TCP, each reason with
    what to change (empty: none this check can see). ``env``: the UCX variables the processes
    ran with; ``resources``: what their UCX context opened (``context_resources``)."""
    out: list[str] = []
    tls = env.get("UCX_TLS")
    if _tls_leaves_out_shm(tls):
        out.append(
            f"UCX_TLS={tls} leaves shared memory out (deliberate where hosts are only network "
            "namespaces of one machine); otherwise add sm, or drop it from the ^ list"
        )
    opened = {r.split("/")[0] for r in resources}
    if resources and not opened & set(SHM_TLS) and not out:
        try:
            st = os.statvfs(shm_dir)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free"
        except OSError:
            free = "missing"
        out.append(
            f"UCX opened no shared-memory transport ({shm_dir}: {free}); give the processes a "
            "/dev/shm (docker: --shm-size, or --ipc=host between containers)"
        )

    def error_handling(tl: str) -> str:
        key = f"UCX_{tl.upper()}_ERROR_HANDLING"
        return env.get(key, env.get("UCX_MM_ERROR_HANDLING", "n")).strip().lower()

    if not any(error_handling(tl) in _TRUE for tl in ("posix", "sysv")):
        set_by = [f"{k}={env[k]}" for k in SHM_ERROR_HANDLING if k in env]
        out.append(
            "ucxx's endpoints handle peer failure, and UCX's posix/sysv transports offer that "
            "only with UCX_MM_ERROR_HANDLING=y (pdserve sets it unless the environment decides: "
            f"{', '.join(set_by) or 'not set here'}); set UCX_MM_ERROR_HANDLING=y"
        )
    return out


def context_resources(info: str) -> list[str]:
    """``transport/device`` of every resource in ``ucp_context_print_info`` text."""
    return [f"{tl}/{dev}" for tl, dev in _RESOURCE_RE.findall(info)]


def process_transports() -> list[str]:
    """``transport/device`` of every resource UCX opened in this process, as ``ucx_facts``
    reads them (at most ``MAX_PROCESS_TRANSPORTS``). Call it once the process's KV endpoint
    exists (UCX configured and started); empty when UCX cannot tell."""
    try:
        import ucxx

        found = context_resources(ucxx.get_ucp_context_info())
    except Exception as exc:  # no UCX here, or it failed to start: the doctor shows "unknown"
        log.debug("UCX resources unknown: %r", exc)
        return []
    return [r[:MAX_TRANSPORT_CHARS] for r in found[:MAX_PROCESS_TRANSPORTS]]


def build_configuration(lib_dir: Path | None) -> str:
    """The ``./configure`` line UCX was built with (from libucx's ``ucx_info``), or ""."""
    import subprocess

    if lib_dir is None:
        return ""
    tool = lib_dir.parent / "bin" / "ucx_info"
    if not tool.is_file():
        return ""
    path = os.pathsep.join(filter(None, [str(lib_dir), os.environ.get("LD_LIBRARY_PATH")]))
    try:
        out = subprocess.run(
            [str(tool), "-v"],
            env={**os.environ, "LD_LIBRARY_PATH": path},
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        if "Configured with:" in line:
            return line.split("Configured with:", 1)[1].strip()
    return ""


def ucx_facts() -> dict[str, Any]:
    """What UCX is in this process, which must have started UCX already (ucxx initialised)."""
    import ucxx

    lib_dir = ucx_library_dir()
    devices = host_devices()
    modules = uct_modules(lib_dir)
    return {
        "version": ".".join(map(str, ucxx.get_ucx_version())),
        "ucxx_version": getattr(ucxx, "__version__", "unknown"),
        "library": str(loaded_ucp_library() or ""),
        "configured_with": build_configuration(lib_dir),
        "modules": modules,
        "resources": context_resources(ucxx.get_ucp_context_info()),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_"))},
        "rdma_devices": devices.rdma,
        "cuda_devices": devices.cuda,
        "findings": [asdict(f) for f in transport_findings(devices=devices, modules=modules)],
    }
