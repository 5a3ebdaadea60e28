"""compose/kubernetes/components/nats-roles: NATS users per role on Kubernetes. Its roles.conf is
what shared/bus/roles.py writes; rendered on overlays/cpu (examples/nats-roles), each Deployment
logs in as its own role (nats-server's checks: tests/integration/test_nats_role_configs.py).

``python -m tests.unit.test_kubernetes_nats_roles`` writes roles.conf again."""

from __future__ import annotations

import pytest

from pdserve.shared.bus.roles import ROLES, authorization_block
from tests.unit.test_kubernetes_manifests import KUBE, KUBECTL, of_kind, render

COMPONENT = KUBE / "components" / "nats-roles"
SECRET = "pdserve-nats-users"


def roles_conf() -> str:
    refs = {role: f"$NATS_{role.upper()}_PASSWORD" for role in ROLES}
    return (
        "# nats.conf plus one user per pdserve role (docs/security.md), written by\n"
        "# `python -m tests.unit.test_kubernetes_nats_roles` from shared/bus/roles.py for the\n"
        "# default namespace, pdserve. The passwords come from the pdserve-nats-users Secret.\n"
        "include ./nats.conf\n\n" + authorization_block("pdserve", refs)
    )


def test_roles_conf_is_what_roles_py_writes() -> None:
    assert (COMPONENT / "roles.conf").read_text() == roles_conf(), f"run python -m {__name__}"


pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl renders the manifests")


def test_each_deployment_logs_in_as_its_role() -> None:
    deployments = of_kind(render("examples/nats-roles"), "Deployment")
    for role in ("gateway", "prefill", "decode"):
        (container,) = deployments[role]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["PDSERVE_NATS_USER"]["value"] == role
        ref = env["PDSERVE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": SECRET, "key": f"NATS_{role.upper()}_PASSWORD"}
        assert "PDSERVE_NATS_URL" in env, "the component adds to the env, never replaces it"


if __name__ == "__main__":
    (COMPONENT / "roles.conf").write_text(roles_conf())
