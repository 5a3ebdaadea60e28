"""pdserve doctor's pieces without processes: UCX host checks, the protocol-table parser, the
verdicts, the report, and the probe messages."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.services.control.doctor import ucx as doctor_ucx
from pdserve.services.control.doctor.report import FAIL, INFO, OK, WARN, Report
from pdserve.services.control.doctor.ucx import PeerRun, parse_ucx_log, tag_send_tables
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.protocol import ProtocolError, decode, encode
from pdserve.shared.bus.subjects import Subjects
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.probe import (
    ProbeLeaseReply,
    ProbePullReply,
    ProbePullRequest,
    probe_subject,
)
from pdserve.shared.kv.ucx_check import HostDevices, transport_findings

RDMA_HOST = HostDevices(rdma=["mlx5_0:1"])
GPU_HOST = HostDevices(cuda=["0000:17:00.0"])

# What UCX 1.21 logs with UCX_PROTO_INFO=y (trimmed), plus one warning.
PROTO_LOG = """\
[1796269530.49] [vm:6861 :0]          parser.c:2355 UCX  WARN  unused environment variable: UCX_FOO
[1796269530.49] [vm:6861 :0]   +--------------------------------+----------------------------+
[1796269530.49] [vm:6861 :0]   | ucp_context_0 intra-node cfg#0 | remote memory write by ucp_put* from host memory to host |
[1796269530.49] [vm:6861 :0]   |                         0..inf | software emulation      | tcp/lo |
[1796269530.49] [vm:6861 :0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory    |
[1796269530.49] [vm:6861 :0]   +--------------------------------+--------------------------------------------+--------+
[1796269530.49] [vm:6861 :0]   |                              0 | eager short                                | tcp/lo |
[1796269530.49] [vm:6861 :0]   |                        1..8191 | eager zero-copy copy-out                   | tcp/lo |
[1796269530.49] [vm:6861 :0]   |                        8K..inf | (?) rendezvous zero-copy                   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
[1796269530.49] [vm:6861 :0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send*(multi) from host memory    |
[1796269530.49] [vm:6861 :0]   |                         0..626 | eager short                                       | tcp/lo |
[1796269531.50] [vm:6870 :0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory    |
[1796269531.50] [vm:6870 :0]   |                              0 | eager short                                | tcp/lo |
"""


# -- host checks (what workers warn about at start-up) -----------------------------------------


@pytest.mark.parametrize(
    ("tls", "rdma", "cuda"),
    [
        (None, True, True),
        ("all", True, True),
        ("tcp", False, False),
        ("rc,tcp", True, False),
        ("^ib", False, True),
        ("^rc", True, True),  # ud and dc stay on
        ("^cuda,ib", False, False),
        ("tcp,cuda_copy", False, True),
    ],
)
def test_ucx_tls_filter(tls: str | None, rdma: bool, cuda: bool) -> None:
    assert ucx_check._tls_allows(tls, ucx_check.RDMA_TLS) is rdma
    assert ucx_check._tls_allows(tls, ucx_check.CUDA_TLS) is cuda


def test_rdma_lost_to_a_build_without_verbs_is_not_deliberate() -> None:
    (found,) = transport_findings({}, RDMA_HOST, ["cma", "cuda"])
    assert found.kind == "rdma" and not found.deliberate
    assert "mlx5_0:1" in found.text and "--without-verbs" in found.text


@pytest.mark.parametrize(
    "env",
    [{"UCX_TLS": "tcp,sm"}, {"UCX_NET_DEVICES": "eth0"}, {"UCX_TLS": "^ib"}],
)
def test_rdma_left_out_by_the_users_variables_is_deliberate(env: dict) -> None:
    (found,) = transport_findings(env, RDMA_HOST, ["ib", "cma"])
    assert found.deliberate and next(iter(env)) in found.text


@pytest.mark.parametrize(
    "env", [{}, {"UCX_NET_DEVICES": "lo,mlx5_0:1"}, {"UCX_NET_DEVICES": "mlx5_0"}]
)
def test_usable_rdma_or_no_hardware_gives_no_finding(env: dict) -> None:
    assert transport_findings(env, RDMA_HOST, ["ib", "cma"]) == []
    assert transport_findings(env, HostDevices(), []) == []


def test_gpus_without_cuda_transport() -> None:
    (found,) = transport_findings({}, GPU_HOST, ["cma"])
    assert found.kind == "cuda" and not found.deliberate
    (found,) = transport_findings({"UCX_TLS": "^cuda"}, GPU_HOST, ["cma", "cuda"])
    assert found.deliberate
    assert transport_findings({}, GPU_HOST, ["cma", "cuda"]) == []


def test_transport_modules_and_devices_from_files(tmp_path: Path) -> None:
    (tmp_path / "lib" / "ucx").mkdir(parents=True)
    for name in ("libuct_ib.so.0", "libuct_ib.so", "libuct_cma.so.0.0.0", "libucm_cuda.so"):
        (tmp_path / "lib" / "ucx" / name).touch()
    assert ucx_check.uct_modules(tmp_path / "lib") == ["cma", "ib"]
    assert ucx_check.uct_modules(None) == []
    (tmp_path / "gpus" / "0000:17:00.0").mkdir(parents=True)
    assert ucx_check.cuda_devices(tmp_path / "gpus", tmp_path) == ["0000:17:00.0"]
    assert ucx_check.cuda_devices(tmp_path / "none", tmp_path) == []


def test_context_resources_are_read_from_ucp_info() -> None:
    info = "#      resource 0  :  md 0  dev 0  flags -- self/memory\n" + (
        "#      resource 1  :  md 1  dev 1  flags -- rc_mlx5/mlx5_0:1\n"
    )
    assert ucx_check.context_resources(info) == ["self/memory", "rc_mlx5/mlx5_0:1"]


def test_workers_warn_at_startup(monkeypatch, caplog) -> None:
    monkeypatch.setattr(ucx_check, "host_devices", lambda: RDMA_HOST)
    monkeypatch.setattr(ucx_check, "uct_modules", lambda lib_dir: ["cma"])
    with caplog.at_level(logging.WARNING, logger="pdserve.shared.kv.ucx_check"):
        assert len(ucx_check.warn_at_startup("decode")) == 1
    assert "decode worker: RDMA devices present" in caplog.text
    assert "pdserve doctor" in caplog.text


# -- UCX protocol tables and the doctor's verdicts ----------------------------------------------


def test_proto_info_tables_are_parsed() -> None:
    tables, problems = parse_ucx_log(PROTO_LOG)
    assert [t.operation.split(" by ")[1] for t in tables] == [
        "ucp_put* from host memory to host",
        "ucp_tag_send* from host memory",
        "ucp_tag_send*(multi) from host memory",
        "ucp_tag_send* from host memory",
    ]
    assert problems == ["WARN  unused environment variable: UCX_FOO"]
    (send,) = tag_send_tables(tables)  # the second process's copy is the same table
    assert send.scope == "intra-node" and len(send.rows) == 3
    assert send.rows[1] == ("1..8191", "eager zero-copy copy-out", "tcp/lo")
    assert send.lanes() == {"tcp/lo", "rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"}


def peer_run(resources: list[str], log: str = PROTO_LOG, **ucx) -> PeerRun:
    tables, problems = parse_ucx_log(log)
    facts = {"resources": resources, "rdma_devices": [], "cuda_devices": [], "findings": []}
    return PeerRun({"ucx": {**facts, **ucx}}, tables, problems, 1.0, "")


def statuses(report: Report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


# The same endpoint once UCX may use shared memory (UCX_MM_ERROR_HANDLING=y, issue 29).
SHM_LOG = """\
[1796392410.14] [vm:8120 :0]   | ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from host memory   |
[1796392410.14] [vm:8120 :0]   |                          0..92 | eager short                                  | sysv/memory |
[1796392410.14] [vm:8120 :0]   |                       93..8191 | eager copy-in copy-out                       | sysv/memory |
[1796392410.14] [vm:8120 :0]   |                        8K..inf | (?) rendezvous fragmented copy-in copy-out   | sysv/memory |
"""
SHM_HOST = ["self/memory", "tcp/lo", "sysv/memory", "posix/memory", "cma/memory"]


def test_two_processes_of_one_host_over_tcp_warn_and_say_why() -> None:
    """UCX titles the table intra-node: TCP there is the slow path (issue 29), never a failure."""
    report = Report()
    env = {"UCX_MM_ERROR_HANDLING": "n"}
    log = PROTO_LOG.split("\n", 1)[1]  # without UCX's warning
    doctor_ucx.add_transport_checks(report, peer_run(SHM_HOST, log, env=env))
    assert statuses(report) == {"resources": INFO, "selected": WARN, "RDMA": OK, "CUDA": OK}
    assert report.exit_code == 0
    selected = report.checks[1]
    # RDMA between two processes of one host loops through the NIC: no better
    assert "not shared memory, for every message size" in selected.summary
    (why,) = [d for d in selected.details if d.startswith("why: ")]
    assert "UCX_MM_ERROR_HANDLING=n" in why and "set UCX_MM_ERROR_HANDLING=y" in why


def test_shared_memory_between_two_processes_passes() -> None:
    report = Report()
    run = peer_run(SHM_HOST, SHM_LOG, env={"UCX_MM_ERROR_HANDLING": "y"})
    doctor_ucx.add_transport_checks(report, run)
    assert statuses(report) == {"resources": INFO, "selected": OK, "RDMA": OK, "CUDA": OK}
    assert report.checks[1].summary == "sysv/memory between two processes"


def test_only_the_sizes_that_miss_shared_memory_are_named() -> None:
    report = Report()
    log = SHM_LOG.replace("| sysv/memory |", "| tcp/lo |", 2)
    doctor_ucx.add_transport_checks(report, peer_run(SHM_HOST, log, env={}))
    assert report.checks[1].status == WARN
    assert report.checks[1].summary.endswith("not shared memory, for 0..92, 93..8191")


def test_tcp_between_hosts_is_not_warned_about() -> None:
    report = Report()
    log = PROTO_LOG.replace("intra-node", "inter-node")
    doctor_ucx.add_transport_checks(report, peer_run(["tcp/eth0"], log))
    assert statuses(report)["selected"] == OK


def test_a_plain_tcp_host_says_tcp_is_all_it_has() -> None:
    report = Report()
    log = "\n".join(line for line in PROTO_LOG.splitlines()[1:] if "rc_mlx5" not in line)
    run = peer_run(["self/memory", "tcp/lo"], log, env={"UCX_MM_ERROR_HANDLING": "y"})
    doctor_ucx.add_transport_checks(report, run)
    selected = report.checks[1]
    assert selected.status == WARN and selected.summary.endswith("for every message size")
    (why,) = [d for d in selected.details if d.startswith("why: ")]
    assert "opened no shared-memory transport" in why and "/dev/shm" in why


@pytest.mark.parametrize(
    ("env", "resources", "reason"),
    [
        ({"UCX_TLS": "^sm", "UCX_MM_ERROR_HANDLING": "y"}, ["tcp/lo"], "UCX_TLS=^sm leaves"),
        ({"UCX_TLS": "tcp,self", "UCX_MM_ERROR_HANDLING": "y"}, ["tcp/lo"], "UCX_TLS=tcp,self"),
        ({"UCX_TLS": "^posix,sysv,cma"}, ["tcp/lo"], "UCX_TLS=^posix,sysv,cma"),
        ({"UCX_MM_ERROR_HANDLING": "y"}, ["self/memory", "tcp/lo"], "no shared-memory"),
        ({}, SHM_HOST, "UCX_MM_ERROR_HANDLING=y (pdserve sets it unless"),
        ({"UCX_MM_ERROR_HANDLING": "y", "UCX_POSIX_ERROR_HANDLING": "off"}, SHM_HOST, None),
        ({"UCX_POSIX_ERROR_HANDLING": "n", "UCX_SYSV_ERROR_HANDLING": "n"}, SHM_HOST, "SYSV"),
        ({"UCX_TLS": "sm,tcp", "UCX_MM_ERROR_HANDLING": "yes"}, SHM_HOST, None),
        ({"UCX_TLS": "^ib", "UCX_POSIX_ERROR_HANDLING": "y"}, SHM_HOST, None),
    ],
)
def test_why_ucx_left_shared_memory_out(env: dict, resources: list, reason: str | None) -> None:
    found = ucx_check.shm_blockers(env, resources)
    if reason is None:
        assert found == []
    else:
        assert found and reason in found[0], found


def test_rdma_hardware_ucx_cannot_use_fails_loudly() -> None:
    finding = {"kind": "rdma", "text": "no verbs in this build", "deliberate": False}
    run = peer_run(["tcp/ib0"], rdma_devices=["mlx5_0:1"], findings=[finding])
    report = Report()
    doctor_ucx.add_transport_checks(report, run)
    rdma = next(c for c in report.checks if c.name == "RDMA")
    assert rdma.status == FAIL and "UNUSED" in rdma.summary and "no verbs" in rdma.summary
    assert report.exit_code == 1
    finding["deliberate"] = True
    report = Report()
    doctor_ucx.add_transport_checks(report, run)
    assert statuses(report)["RDMA"] == WARN


def test_rdma_available_but_not_selected_warns() -> None:
    log = "\n".join(line for line in PROTO_LOG.splitlines() if "rc_mlx5" not in line)
    report = Report()
    doctor_ucx.add_transport_checks(
        report, peer_run(["tcp/lo", "rc_mlx5/mlx5_0:1"], log, rdma_devices=["mlx5_0:1"])
    )
    assert statuses(report)["RDMA"] == WARN
    report = Report()
    doctor_ucx.add_transport_checks(
        report, peer_run(["rc_mlx5/mlx5_0:1"], PROTO_LOG, rdma_devices=["mlx5_0:1"])
    )
    assert statuses(report)["RDMA"] == OK


def case(size: float, pull: float, raw: float) -> dict:
    return {"size_mib": size, "pull_gbps": pull, "raw_gbps": raw, "ratio": pull / raw}


@pytest.mark.parametrize(
    ("cases", "min_gbps", "status"),
    [
        ([case(1, 0.9, 1.0), case(64, 1.0, 1.0)], 0.0, OK),
        ([case(1, 0.7, 1.0), case(64, 1.0, 1.0)], 0.0, WARN),
        ([case(1, 0.4, 1.0), case(64, 1.0, 1.0)], 0.0, WARN),  # 1 MiB: latency-bound
        ([case(1, 1.0, 1.0), case(64, 0.4, 1.0)], 0.0, FAIL),
        ([case(1, 0.4, 1.0)], 0.0, FAIL),  # the largest size is always judged
        ([case(1, 0.9, 1.0)], 5.0, FAIL),
        ([case(1, 0.1, 0.1), case(8, 6.0, 6.0)], 5.0, OK),
    ],
)
def test_peer_test_verdict(cases: list[dict], min_gbps: float, status: str) -> None:
    report = Report()
    run = PeerRun({"cases": cases}, [], [], 2.0, "")
    doctor_ucx.add_peer_check(report, run, "127.0.0.1", 0.5, min_gbps, 5)
    (check,) = report.checks
    assert check.status == status
    assert len(check.details) == 1 + len(cases) and "pull/raw" in check.details[0]


def test_peer_test_that_moved_nothing_fails_with_the_reason() -> None:
    report = Report()
    run = PeerRun({"error": "KVTransferError: refused"}, [], [], 2.0, "line 1\nboom\n")
    doctor_ucx.add_peer_check(report, run, "10.0.0.1", 0.5, 0.0, 5)
    (check,) = report.checks
    assert (
        check.status == FAIL
        and "refused" in check.summary
        and check.details
        == [
            "line 1",
            "boom",
        ]
    )


def test_report_ends_in_a_verdict_and_exit_code(tmp_path: Path) -> None:
    report = Report(header=["host x"])
    report.add("a", OK, "fine")
    report.add("longer name", WARN, "hmm", ["detail"])
    text = report.render()
    assert "[ OK ] a            fine" in text and "[WARN] longer name  hmm" in text
    assert text.splitlines()[-1] == "passed: 0 failed, 1 warning(s), 1 ok -> exit 0"
    report.add("b", FAIL, "broken")
    assert report.exit_code == 1 and report.render().endswith("-> exit 1")
    report.write_json(tmp_path / "r.json")
    assert '"exit_code": 1' in (tmp_path / "r.json").read_text()


# -- probe messages -----------------------------------------------------------------------------


def handle() -> KVHandle:
    return KVHandle("p0", "ucx1:00:AA==", [3], 1, {"model": "m"}, 1.0, "secret")


def test_probe_messages_round_trip_and_are_checked() -> None:
    for msg in (
        ProbeLeaseReply("doctor-1", "p0", "ok", handle()),
        ProbePullRequest("doctor-1", handle(), pulls=2),
        ProbePullReply("doctor-1", "d0", "ok", [0.01, 0.002], 4096, True),
    ):
        assert decode(encode(msg)) == msg
    with pytest.raises(ProtocolError, match="must not be null"):
        decode(encode(ProbePullRequest("doctor-1", None)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        decode(encode(ProbePullRequest("doctor-1", handle(), pulls=1000)))
    with pytest.raises(ProtocolError):
        decode(encode(ProbeLeaseReply("doctor-1", "p0", "maybe")))
    assert probe_subject(Subjects("ns"), "d0") == "ns.probe.d0"
    with pytest.raises(ValueError):
        probe_subject(Subjects("ns"), "d0.>")


# -- the stack check's verdicts, with canned worker replies --------------------------------------


async def test_stack_check_summarises_many_pairs_and_lists_each_failure() -> None:
    from pdserve.services.control.doctor.stack import StackCheck
    from pdserve.shared.bus.discovery_messages import WorkerLoad
    from pdserve.shared.config import BusConfig
    from pdserve.shared.kv.probe import ProbeLeaseRequest

    check = StackCheck(BusConfig(), timeout=1.0)  # never connected: releases are best effort
    decode = [f"d{i}" for i in range(8)]
    for worker_id, role in [("p0", "prefill"), *((d, "decode") for d in decode)]:
        check.loads[worker_id] = WorkerLoad(worker_id, role, "m", 10, 10, 0, 0)
    rdma = ["RDMA devices present (mlx5_0:1) but ..."]

    async def ask(worker_id: str, msg, reply_type, timeout):
        if isinstance(msg, ProbeLeaseRequest):
            return ProbeLeaseReply(msg.probe_id, worker_id, "ok", handle(), warnings=rdma)
        if worker_id == "d3":
            return ProbePullReply(msg.probe_id, worker_id, "failed", error="timed out")
        if worker_id == "d5":
            return "d5 did not answer within 1s"
        return ProbePullReply(
            msg.probe_id, worker_id, "ok", [0.02, 0.001, 0.003], 64, True, None, rdma
        )

    check._ask = ask  # type: ignore[method-assign]
    report = Report()
    await check.run(report, discover_seconds=0)
    lines = [(c.name, c.status, c.summary) for c in report.checks]
    assert lines[0][:2] == ("stack", OK) and "1 prefill, 8 decode" in lines[0][2]
    failed = [s for n, st, s in lines if st == FAIL]
    assert failed == ["d3 <- p0: failed: timed out", "d5 <- p0: d5 did not answer within 1s"]
    (pulls,) = [s for n, st, s in lines if n == "KV pull" and st == OK]
    assert pulls.startswith("6 worker pairs, bytes verified: first pull 20.0 ms-20.0 ms")
    (warned,) = [c for c in report.checks if c.name == "worker UCX"]  # one line for all
    assert warned.status == WARN and "d0, d1" in warned.summary and "1 more" in warned.summary
    assert warned.details == rdma


def test_hardware_is_still_judged_when_ucx_did_not_start(monkeypatch) -> None:
    monkeypatch.setattr(ucx_check, "host_devices", lambda: RDMA_HOST)
    monkeypatch.setattr(ucx_check, "uct_modules", lambda lib_dir: ["cma"])
    report = Report()
    doctor_ucx.add_transport_checks(report, PeerRun({"error": "no device"}, [], [], 1.0, ""))
    assert statuses(report) == {"resources": INFO, "selected": WARN, "RDMA": FAIL, "CUDA": OK}
    assert doctor_ucx.header_lines({})[0].startswith("UCX: did not start")
