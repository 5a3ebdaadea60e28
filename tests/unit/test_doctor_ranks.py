"""``pdserve doctor``'s TP ranks without processes: each rank's pid and UCX transports on the
wire (probe replies), how the report shows them, and how a process reads its own transports."""

from __future__ import annotations

import sys
import types

import msgpack
import pytest

from pdserve.services.control.doctor.ranks import (
    add_rank_check,
    compact_transports,
    rank_line,
    uneven_ranks,
)
from pdserve.services.control.doctor.report import OK, WARN, Report
from pdserve.shared.bus.protocol import ProtocolError, decode, encode
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.probe import (
    MAX_RANK_TRANSPORTS,
    MAX_TP_RANKS,
    ProbeLeaseReply,
    ProbePullReply,
)

LOOPBACK = ["self/memory", "tcp/lo", "sysv/memory", "posix/memory", "cma/memory"]
RDMA = ["self/memory", "rc_mlx5/mlx5_0:1", "dc_mlx5/mlx5_0:1", "tcp/eth0", "cuda_copy/cuda"]


def test_the_line_of_a_tp_2_worker() -> None:
    line = rank_line("prefill-0", [123, 124], [["self/memory", "tcp/lo"], ["tcp/lo"]])
    assert line == "prefill-0: TP 2 (rank 0 pid 123: tcp/lo; rank 1 pid 124: tcp/lo)"


def test_transports_are_grouped_by_device_without_self() -> None:
    assert compact_transports(LOOPBACK) == "tcp/lo, sysv+posix+cma/memory"
    assert compact_transports(RDMA) == "rc_mlx5+dc_mlx5/mlx5_0:1, tcp/eth0, cuda_copy/cuda"
    assert compact_transports(["tcp/lo", "tcp/lo"]) == "tcp/lo"
    assert compact_transports(["self/memory"]) == compact_transports([]) == ""
    line = rank_line("d0", [7, 8, 9], [LOOPBACK, [], ["tcp/lo"]])
    assert "rank 1 pid 8: transports unknown" in line and line.startswith("d0: TP 3 (")


def test_ranks_missing_a_transport_are_named() -> None:
    assert uneven_ranks([LOOPBACK, LOOPBACK]) == []
    own_nic = ["tcp/eth1", "rc_mlx5/mlx5_1:1", "dc_mlx5/mlx5_1:1", "cuda_copy/cuda"]
    assert uneven_ranks([RDMA, own_nic]) == []  # devices may differ per rank, transports not
    assert uneven_ranks([RDMA, ["tcp/eth0"]]) == ["rank 1 has no cuda_copy, dc_mlx5, rc_mlx5"]
    assert uneven_ranks([RDMA, []]) == []  # unknown is not compared


def test_report_lists_tp_workers_only() -> None:
    report = Report()
    add_rank_check(report, {"p0": ([], []), "d0": ([5], [LOOPBACK])})
    assert report.checks == [] and "tp_ranks" not in report.data  # TP 1 everywhere: no check
    facts = {"prefill-0": ([123, 124], [LOOPBACK, LOOPBACK]), "decode-0": ([], [])}
    add_rank_check(report, facts)
    (check,) = report.checks
    assert check.name == "TP ranks" and check.status == OK
    assert check.details == [
        "prefill-0: TP 2 (rank 0 pid 123: tcp/lo, sysv+posix+cma/memory; "
        "rank 1 pid 124: tcp/lo, sysv+posix+cma/memory)"
    ]
    assert report.data["tp_ranks"] == {
        "prefill-0": [
            {"rank": 0, "pid": 123, "transports": LOOPBACK},
            {"rank": 1, "pid": 124, "transports": LOOPBACK},
        ]
    }
    assert "rank 1 pid 124" in report.render()


def test_report_warns_when_ranks_differ() -> None:
    report = Report()
    add_rank_check(report, {"p0": ([10, 11], [RDMA, ["tcp/eth0"]]), "d0": ([20, 21], [RDMA, RDMA])})
    (check,) = report.checks
    assert check.status == WARN and "p0: rank 1 has no cuda_copy" in check.summary
    assert [d.split(":")[0] for d in check.details] == ["d0", "p0"]


@pytest.mark.parametrize("cls", [ProbeLeaseReply, ProbePullReply])
def test_rank_facts_cross_the_wire(cls) -> None:
    reply = cls("doctor-1", "p0", "ok", rank_pids=[123, 124], rank_transports=[LOOPBACK, []])
    back = decode(encode(reply))
    assert back.rank_pids == [123, 124] and back.rank_transports == [LOOPBACK, []]
    plain = decode(encode(cls("doctor-1", "p0", "refused")))
    assert plain.rank_pids == [] and plain.rank_transports == []


@pytest.mark.parametrize(
    ("pids", "transports", "why"),
    [
        ([1, 2], [["tcp/lo"]], "rank transport lists"),  # lists of different lengths
        ([0, 2], [[], []], "ints in"),  # not a pid
        ([1, 2], [["tcp/lo"], [3]], "expected str"),
        ([1, 2], [[], ["x" * 65]], "over 64 chars"),
        ([1, 2], [[], ["t/d"] * (MAX_RANK_TRANSPORTS + 1)], "more than"),
        (list(range(1, MAX_TP_RANKS + 2)), [[]] * (MAX_TP_RANKS + 1), "more than"),
    ],
)
def test_bad_rank_facts_are_refused(pids, transports, why) -> None:
    good = encode(ProbeLeaseReply("doctor-1", "p0", "ok"))
    body = msgpack.unpackb(good)
    body.update(rank_pids=pids, rank_transports=transports)
    with pytest.raises(ProtocolError, match=why):
        decode(msgpack.packb(body))


def test_a_process_reads_its_own_transports(monkeypatch) -> None:
    info = (
        "#\n# resource 0  :  md 0  dev 0  flags -- self/memory\n"
        "# resource 1  :  md 1  dev 1  flags -- tcp/lo\n"
    )
    fake = types.SimpleNamespace(get_ucp_context_info=lambda: info)
    monkeypatch.setitem(sys.modules, "ucxx", fake)
    assert ucx_check.process_transports() == ["self/memory", "tcp/lo"]

    def broken() -> str:
        raise RuntimeError("no UCX context")

    monkeypatch.setitem(sys.modules, "ucxx", types.SimpleNamespace(get_ucp_context_info=broken))
    assert ucx_check.process_transports() == []
