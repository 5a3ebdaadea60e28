"""Per-role NATS users (shared/bus/roles.py): each role may say exactly what its part of the flow
needs (nats-server's ``-t`` checks of the configuration: tests/integration/test_nats_role_configs.py)."""

from __future__ import annotations

import pytest

from pdserve.shared.bus.roles import permissions
from pdserve.shared.bus.subjects import Subjects
from tests.bus_memory import subject_matches

S = Subjects("pdserve")


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(subject_matches(p, subject) for p in patterns)


# (role, publishes?, subject, allowed?)
MATRIX = [
    ("gateway", True, S.prefill("p0"), True),
    ("gateway", True, S.decode("d0"), True),
    ("gateway", True, S.cancel, True),
    ("gateway", True, S.lease("p0"), True),
    ("gateway", True, "pdserve.admin.p0", True),
    ("gateway", True, "pdserve.admin.p0.lora", True),
    ("gateway", True, "pdserve.admin.p0.other", False),
    ("gateway", True, "$KV.pdserve_responses.resp_1", True),
    ("gateway", True, "$JS.API.STREAM.CREATE.KV_pdserve_responses", True),
    ("gateway", True, "$JS.API.STREAM.DELETE.KV_other", False),  # only its own bucket
    ("gateway", True, S.gateway("g1"), False),  # cannot forge tokens to another gateway
    ("gateway", True, S.load("decode", "d0"), False),  # nor pose as a worker
    ("gateway", False, S.gateway("g1"), True),
    ("gateway", False, S.all_loads, True),
    ("gateway", False, S.all_kv, True),
    ("gateway", False, S.prefill("p0"), False),
    ("prefill", False, S.prefill("p0"), True),
    ("prefill", False, S.lease("p0"), True),
    ("prefill", False, S.cancel, True),
    ("prefill", False, S.decode("d0"), False),
    ("prefill", False, S.gateway("g1"), False),  # no reading other requests' tokens
    ("prefill", True, S.gateway("g1"), True),
    ("prefill", True, S.load("prefill", "p0"), True),
    ("prefill", True, S.load("decode", "p0"), False),  # cannot pose as another role
    ("prefill", True, S.kv("p0"), True),
    ("prefill", True, S.prefill("p1"), False),
    ("prefill", True, S.cancel, False),
    ("decode", True, S.lease("p0"), True),  # releases after a pull
    ("decode", True, S.prefill("p0"), False),  # the test of issue 45
    ("decode", True, "pdserve.admin.p0", False),
    ("decode", True, "pdserve.admin.p0.lora", False),
    ("decode", False, "pdserve.admin.d0.lora", True),
    ("prefill", False, "pdserve.admin.p0.lora", True),
    ("decode", True, S.cancel, False),
    ("decode", False, S.decode("d0"), True),
    ("decode", False, S.loads_of("prefill"), True),
    ("decode", False, S.gateway("g1"), False),
    ("decode", False, S.prefill("p0"), False),
    ("control", True, S.prefill("p0"), True),
    ("control", False, "pdserve.control.launcher", True),
]


@pytest.mark.parametrize(("role", "publish", "subject", "ok"), MATRIX)
def test_each_role_may_say_only_its_part(role: str, publish: bool, subject: str, ok: bool):
    perms = permissions("pdserve", role)
    assert allowed(perms.publish if publish else perms.subscribe, subject) is ok


def test_workers_answer_requests_through_allow_responses_only() -> None:
    for role in ("prefill", "decode"):
        perms = permissions("pdserve", role)
        assert perms.allow_responses
        assert not allowed(perms.publish, "_INBOX.abc.1")
    assert not permissions("pdserve", "gateway").allow_responses


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown bus role"):
        permissions("pdserve", "attacker")
