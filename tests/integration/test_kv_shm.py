"""KV pulls between two processes of one host go over shared memory (issue 29).

Real UCX, two processes: the doctor's peer test (``services/control/doctor/kv_peer.py``) runs a real
``KVServer`` in one and pulls from it with a real ``KVClient`` in the other, with UCX's protocol
report on (``UCX_PROTO_INFO=y``). Each process logs, per endpoint, the lanes UCX gave tagged
messages of each size; the row holding the pull's message size says what carried it.

Before the fix UCX put every size on ``tcp/lo``: ucxx's endpoints handle peer failure, and
posix/sysv offer that only with ``UCX_MM_ERROR_HANDLING=y`` (``shared/kv/ucx_config.py``). The
same run with that variable back at UCX's default ``n`` - what reverting the fix gives - must
show TCP again, and a user's ``UCX_TLS=^sm`` (tests/multihost's namespaces) must still win.
"""

from __future__ import annotations

import re

import pytest

from pdserve.services.control.doctor import ucx as doctor_ucx
from pdserve.services.control.doctor.ucx import PeerRun, ProtoTable
from pdserve.shared.kv.ucx_check import SHM_TLS
from pdserve.shared.kv.ucx_config import SHM_ERROR_HANDLING
from tests.integration.stack import QUIET_ENV

SIZE_MIB = 1.0
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_BOUND = re.compile(r"^(\d+)([KMG]?)$")


def _bytes(text: str) -> float:
    if text == "inf":
        return float("inf")
    m = _BOUND.match(text)
    assert m, f"not a UCX size: {text!r}"
    return int(m.group(1)) * _UNITS[m.group(2)]


def lanes_for(table: ProtoTable, size: int) -> list[str]:
    """The ``transport/device`` lanes of the row of ``table`` that holds ``size`` bytes."""
    for sizes, _, text in table.rows:
        lo, _, hi = sizes.partition("..")
        if _bytes(lo) <= size <= _bytes(hi or lo):
            return [f"{t}/{d}" for t, d in re.findall(r"\b([a-z][a-z0-9_]*)/(\S+)", text)]
    raise AssertionError(f"no row for {size} bytes in {table.rows}")


async def pull_between_two_processes(monkeypatch: pytest.MonkeyPatch, **env: str) -> PeerRun:
    """The peer test at 1 MiB, in an environment that has only ``env`` of the UCX variables
    this issue is about (the children inherit it)."""
    for key in (*SHM_ERROR_HANDLING, "UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**QUIET_ENV, **env}.items():
        monkeypatch.setenv(key, value)
    run = await doctor_ucx.run_peer_test("127.0.0.1", [SIZE_MIB], 1, 0, timeout=120)
    (case,) = run.outcome.get("cases") or pytest.fail(f"no pull: {run.outcome} {run.output}")
    assert case["num_bytes"] == 1 << 20 and case["pull_gbps"] > 0  # bytes checked by kv_peer
    return run


def pull_lanes(run: PeerRun) -> list[str]:
    """What carried the pull's message, from each process's intra-node tag-send table."""
    tables = [t for t in doctor_ucx.tag_send_tables(run.tables) if t.scope == "intra-node"]
    assert tables, f"UCX reported no intra-node endpoint: {run.output[-2000:]}"
    return sorted({lane for t in tables for lane in lanes_for(t, int(SIZE_MIB * (1 << 20)))})


async def test_a_pull_between_two_processes_of_one_host_uses_shared_memory(monkeypatch) -> None:
    run = await pull_between_two_processes(monkeypatch)
    lanes = pull_lanes(run)
    assert lanes and all(lane.split("/")[0] in SHM_TLS for lane in lanes), lanes
    resources = run.outcome["ucx"]["resources"]
    assert "tcp/lo" in resources  # TCP stays open for peers on other hosts
    env = run.outcome["ucx"]["env"]
    assert env.get("UCX_MM_ERROR_HANDLING") == "y" and env.get("UCX_KEEPALIVE_INTERVAL")
    # and every size of that endpoint, not only the pull's
    for t in doctor_ucx.tag_send_tables(run.tables):
        assert t.network_rows() == [], t.rows


@pytest.mark.parametrize(
    "env",
    [
        {"UCX_MM_ERROR_HANDLING": "n"},  # UCX's default: the fix reverted
        {"UCX_TLS": "^sm"},  # tests/multihost: hosts that are namespaces of one machine
    ],
    ids=["mm-error-handling-off", "tls-without-sm"],
)
async def test_without_it_the_pull_goes_over_tcp(monkeypatch, env: dict[str, str]) -> None:
    lanes = pull_lanes(await pull_between_two_processes(monkeypatch, **env))
    assert lanes == ["tcp/lo"], lanes
