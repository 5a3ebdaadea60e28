"""compose/kubernetes/components/nats-roles: NATS users per role on Kubernetes. Its roles.conf is
what shared/bus/roles.py writes and nats-server accepts (``-t``, with the rendered nats.conf it
includes); rendered on overlays/cpu (examples/nats-roles), the NATS nodes run it with every
password from the Secret, and each Deployment logs in as its own role.

``python -m tests.unit.test_kubernetes_nats_roles`` writes roles.conf again."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdserve.services.control.processes import find_nats_server
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


def test_nats_nodes_run_roles_conf_with_the_passwords(tmp_path: Path) -> None:
    objects = render("examples/nats-roles")
    config = of_kind(objects, "ConfigMap")
    (nats_config,) = [m for name, m in config.items() if name.startswith("nats-config")]
    for name, text in nats_config["data"].items():
        (tmp_path / name).write_text(text)
    (container,) = of_kind(objects, "StatefulSet")["nats"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["nats-server", "--config", "/etc/nats/roles.conf"]
    env = {e["name"]: e for e in container["env"]}
    passwords = {f"NATS_{role.upper()}_PASSWORD": f"pw-{role}" for role in ROLES}
    for key in passwords:
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": key}
    test = [find_nats_server(), "-t", "-c", str(tmp_path / "roles.conf")]
    done = subprocess.run(
        test, env={**passwords, "POD_NAME": "nats-0"}, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


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
