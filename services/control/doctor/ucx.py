"""The doctor's local checks: which transports UCX really picks between two pdserve processes,
and how fast pdserve's pull is next to a raw UCX send of the same bytes.

Both come from one run of ``pdserve.services.control.doctor.kv_peer`` in child processes (a decode side that
measures and the prefill side it starts), so the doctor itself never loads UCX. The children run
with ``UCX_PROTO_INFO=y``: when UCX sets up an endpoint it logs, per operation and message size,
the protocol it chose and the lanes (``transport/device``) that carry it. That table - written to
``UCX_LOG_FILE``, one file per process - is the only first-hand record of the selection; ucxx has
no endpoint query, and the context's resource list only says what UCX *could* use.

Both test processes run on this host, and UCX titles such a table ``intra-node``: when its lanes
are TCP rather than shared memory, the doctor warns and says why (``ucx_check.shm_blockers``) -
on a 2-core VM that was 0.5-1.3 GB/s where shared memory moves 5-9 (issue 29).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.services.control.doctor.report import FAIL, INFO, OK, WARN, Report
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.ucx_check import is_cuda, is_intra_host, is_rdma

TARGET_RATIO = 0.8  # perf/kv_bench's target: below it the doctor warns
BANDWIDTH_BOUND_MIB = 8.0  # pulls from this size on are judged against --min-ratio/--min-gbps
_LOG_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s?(.*)$")
_TABLE_TITLE = re.compile(r"^\S+\s+(intra-node|inter-node)\s+cfg#\d+$")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:\-]+)")
_BUILD_FLAG = re.compile(
    r"--with(?:out)?-(?:verbs|rdmacm|cuda|rocm|gdrcopy|mlx5|efa|knem|xpmem)\S*"
)
PEER_MODULE = "pdserve.services.control.doctor.kv_peer"
# set for the test's children only: not what a worker runs with, so not reported as such
DOCTOR_ONLY_ENV = ("UCX_PROTO_INFO", "UCX_LOG_FILE", "UCX_WARN_UNUSED_ENV_VARS")


@dataclass
class ProtoTable:
    """One ``UCX_PROTO_INFO`` table: how UCX moves one kind of operation on one endpoint."""

    scope: str  # intra-node / inter-node
    operation: str  # e.g. "tagged message by ucp_tag_send* from host memory"
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # size range, protocol, lanes

    def lanes(self) -> set[str]:
        return {f"{t}/{d}" for _, _, text in self.rows for t, d in _LANE.findall(text)}

    def network_rows(self) -> list[str]:
        """Size ranges whose lanes are all network transports (none shared memory)."""
        return [
            size
            for size, _, text in self.rows
            if (found := _LANE.findall(text)) and not any(is_intra_host(t) for t, _ in found)
        ]


def parse_ucx_log(text: str) -> tuple[list[ProtoTable], list[str]]:
    """Protocol tables and WARN/ERROR lines from UCX's log output."""
    tables: list[ProtoTable] = []
    problems: list[str] = []
    for raw in text.splitlines():
        m = _LOG_PREFIX.match(raw)
        line = (m.group(1) if m else raw).strip()
        if " UCX  WARN " in raw or " UCX  ERROR " in raw:
            problems.append(re.sub(r"^.*UCX\s+", "", raw).strip())
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and (title := _TABLE_TITLE.match(cells[0])):
            tables.append(ProtoTable(title.group(1), cells[1]))
        elif len(cells) == 3 and tables:
            tables[-1].rows.append((cells[0], cells[1], cells[2]))
    return tables, problems


def tag_send_tables(tables: list[ProtoTable]) -> list[ProtoTable]:
    """The tables of plain tagged sends - what pdserve's KV messages use - one per scope and
    memory type (both processes log the same ones)."""
    seen: dict[tuple[str, str], ProtoTable] = {}
    for t in tables:
        if re.match(r"tagged message by ucp_tag_send\* from", t.operation) and t.rows:
            seen.setdefault((t.scope, t.operation), t)
    return list(seen.values())


@dataclass
class PeerRun:
    """What one run of the peer test left behind."""

    outcome: dict[str, Any]
    tables: list[ProtoTable]
    problems: list[str]
    seconds: float
    output: str  # the children's stdout/stderr, for a failure's reason


async def run_peer_test(
    host: str, sizes_mib: list[float], reps: int, warmup: int, timeout: float
) -> PeerRun:
    """Run the peer test in child processes with UCX's protocol report on."""
    with tempfile.TemporaryDirectory(prefix="pdserve-doctor-") as tmp:
        result = Path(tmp) / "result.json"
        env = {
            **os.environ,
            "UCX_PROTO_INFO": "y",
            "UCX_LOG_FILE": str(Path(tmp) / "ucx.%p.log"),
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "OMP_NUM_THREADS": "1",
        }
        # a fixed port (a worker's --ucx-port exported to UCX) would be taken by the worker
        # itself, or by the first of the two test processes
        env.pop("UCX_TCP_PORT_RANGE", None)
        argv = [
            sys.executable,
            "-m",
            PEER_MODULE,
            "--measure",
            "--result",
            str(result),
            "--host",
            host,
            "--reps",
            str(reps),
            "--warmup",
            str(warmup),
            "--sizes-mib",
            *(f"{s:g}" for s in sizes_mib),
        ]
        t0 = time.monotonic()
        child = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            out, _ = await asyncio.wait_for(child.communicate(), timeout)
        except asyncio.TimeoutError:
            child.kill()
            out, _ = await child.communicate()
            out += f"\n(peer test killed after {timeout:.0f}s)".encode()
        seconds = time.monotonic() - t0
        if result.exists():
            outcome: dict[str, Any] = json.loads(result.read_text())
        else:
            outcome = {"error": f"the peer test exited with {child.returncode} and no result"}
        log_text = "\n".join(p.read_text(errors="replace") for p in Path(tmp).glob("ucx.*.log"))
    tables, problems = parse_ucx_log(log_text)
    return PeerRun(
        outcome=outcome,
        tables=tables,
        problems=problems,
        seconds=seconds,
        output=out.decode(errors="replace"),
    )


def header_lines(ucx: dict[str, Any]) -> list[str]:
    if "version" not in ucx:
        return ["UCX: did not start in the test processes (UCX log and peer test below)"]
    flags = " ".join(_BUILD_FLAG.findall(ucx.get("configured_with", ""))) or "unknown"
    shown = {k: v for k, v in ucx.get("env", {}).items() if k not in DOCTOR_ONLY_ENV}
    env = " ".join(f"{k}={v}" for k, v in shown.items()) or "none"
    return [
        f"UCX {ucx.get('version', '?')} (ucxx {ucx.get('ucxx_version', '?')}): "
        f"{ucx.get('library') or 'library path unknown'}",
        f"UCX build: {flags}; transport modules: {', '.join(ucx.get('modules', [])) or 'none'}",
        f"UCX env of the test: {env}",
    ]


def add_transport_checks(report: Report, run: PeerRun) -> None:
    """Resources, selected lanes, and RDMA/CUDA hardware that UCX left unused."""
    ucx = run.outcome.get("ucx") or _facts_without_ucx()
    resources: list[str] = ucx.get("resources", [])
    report.add("resources", INFO, " ".join(resources) or "unknown (UCX did not start)")
    sends = tag_send_tables(run.tables)
    selected = sorted({lane for t in run.tables for lane in t.lanes()})
    if not resources:
        report.add("selected", WARN, "unknown: the test processes never got an endpoint")
    elif sends:
        details = []
        for t in sends:
            details.append(f"{t.operation} ({t.scope}):")
            details += [f"  {r:<12} {p:<44} {lanes}" for r, p, lanes in t.rows]
        intra = [t for t in sends if t.scope == "intra-node"]
        over_net = [r for t in intra for r in t.network_rows()]
        if over_net and len(over_net) == sum(len(t.rows) for t in intra):
            over_net = ["every message size"]
        if over_net:
            env = ucx.get("env", {})
            why = ucx_check.shm_blockers(env, resources) or [
                "not visible from here: rerun with UCX_TLS=sm,self UCX_LOG_LEVEL=info, UCX "
                "logs why each shared-memory transport cannot reach the peer"
            ]
            report.add(
                "selected",
                WARN,
                f"!! {', '.join(selected)} between two processes of "
                f"this host: the network, not shared memory, for {', '.join(over_net)}",
                [*(f"why: {w}" for w in why), *details],
            )
        else:
            report.add("selected", OK, f"{', '.join(selected)} between two processes", details)
    else:
        report.add(
            "selected", WARN, "UCX logged no protocol table (UCX_PROTO_INFO needs UCX >= 1.13)"
        )
    findings = ucx.get("findings", [])
    for kind, devices, check in (
        ("rdma", ucx.get("rdma_devices", []), is_rdma),
        ("cuda", ucx.get("cuda_devices", []), is_cuda),
    ):
        name = kind.upper()
        if not devices:
            where = "/sys/class/infiniband" if kind == "rdma" else "NVIDIA driver"
            report.add(name, OK, f"no {name} device on this host ({where})")
            continue
        usable = [r for r in resources if check(r.split("/")[0])]
        used = [lane for lane in selected if check(lane.split("/")[0])]
        mine = [f for f in findings if f["kind"] == kind]
        if not usable:
            why = mine[0]["text"] if mine else f"UCX opened no {name} transport"
            status = WARN if mine and mine[0]["deliberate"] else FAIL
            report.add(name, status, f"!! {len(devices)} device(s) UNUSED: {why}", devices)
        elif kind == "rdma" and not used:
            report.add(
                name,
                WARN,
                f"!! {', '.join(usable)} available but the test used "
                f"{', '.join(selected) or 'nothing'}; both ends were on this host, so "
                "UCX may still pick RDMA between hosts",
            )
        else:
            report.add(
                name,
                OK,
                f"UCX can use {', '.join(usable)}"
                + ("" if kind == "rdma" else " (the test moved host memory)"),
            )
    if run.problems:
        report.add("UCX log", WARN, f"{len(run.problems)} warning(s) from UCX", run.problems[:5])


def _facts_without_ucx() -> dict[str, Any]:
    """The hardware half of ``ucx_facts``, read here when the test processes could not start
    UCX (so their report is missing): what the host has is known all the same."""
    devices = ucx_check.host_devices()
    findings = ucx_check.transport_findings(devices=devices)
    return {
        "rdma_devices": devices.rdma,
        "cuda_devices": devices.cuda,
        "findings": [asdict(f) for f in findings],
    }


def add_peer_check(
    report: Report, run: PeerRun, host: str, min_ratio: float, min_gbps: float, reps: int
) -> None:
    """The bandwidth table and its verdict."""
    cases = run.outcome.get("cases")
    if not cases:
        why = run.outcome.get("error") or "no result"
        tail = [line for line in run.output.strip().splitlines()[-4:] if line.strip()]
        report.add("peer test", FAIL, f"no transfer completed over {host}: {why}", tail)
        return
    details = [f"{'size':>9} {'pull GB/s':>10} {'raw GB/s':>9} {'pull/raw':>9}"]
    # Small pulls are latency-bound: a round trip more than raw UCX costs them a visible share
    # and jitters with the machine's load, so only bandwidth-bound sizes can fail.
    judged = {id(c) for c in cases if c["size_mib"] >= BANDWIDTH_BOUND_MIB} or {
        id(max(cases, key=lambda c: c["size_mib"]))
    }
    failed, warned = [], []
    for c in cases:
        details.append(
            f"{c['size_mib']:>5g} MiB {c['pull_gbps']:>10.3f} {c['raw_gbps']:>9.3f} "
            f"{c['ratio']:>8.2f}x"
        )
        label = f"{c['size_mib']:g} MiB"
        if id(c) in judged and c["ratio"] < min_ratio:
            failed.append(f"{label}: pull/raw {c['ratio']:.2f} < --min-ratio {min_ratio:g}")
        elif id(c) in judged and c["pull_gbps"] < min_gbps:
            failed.append(f"{label}: {c['pull_gbps']:.3f} GB/s < --min-gbps {min_gbps:g}")
        elif c["ratio"] < TARGET_RATIO:
            warned.append(f"{label}: pull/raw {c['ratio']:.2f} < {TARGET_RATIO}")
    status = FAIL if failed else WARN if warned else OK
    verdict = "; ".join(failed or warned) or "pdserve's pull keeps up with raw UCX"
    summary = f"2 processes over {host}, median of {reps}, {run.seconds:.1f}s: {verdict}"
    report.add("peer test", status, summary, details)
