"""nats-server accepts the per-role users that shared/bus/roles.py writes (``nats-server -t``):
as ``pdserve up`` writes them, with ``$VARIABLE`` passwords (compose, Kubernetes) only when the
variables are set, and as the Kubernetes component renders them on overlays/cpu."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdserve.services.control.processes import NatsServer, find_nats_server
from pdserve.shared.bus.roles import ROLES, authorization_block, new_passwords
from tests.unit.test_kubernetes_manifests import KUBECTL, of_kind, render
from tests.unit.test_kubernetes_nats_roles import SECRET


def nats_config_test(conf: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        env=env or {},
        timeout=30,
    )


def test_generated_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    passwords = new_passwords()
    assert set(passwords) == set(ROLES) and len(set(passwords.values())) == len(ROLES)
    server = NatsServer(workdir=tmp_path, authorization=authorization_block("ns-1", passwords))
    conf = tmp_path / "nats.conf"
    conf.write_text(server.config_text())
    done = nats_config_test(conf)
    assert done.returncode == 0, done.stderr
    for password in passwords.values():
        assert f'password: "{password}"' in conf.read_text()


def test_password_variables_are_resolved_by_nats_server(tmp_path: Path) -> None:
    """Compose and Kubernetes hand the passwords to nats-server in its environment."""
    refs = {role: f"$PDSERVE_NATS_{role.upper()}_PASSWORD" for role in ROLES}
    conf = tmp_path / "roles.conf"
    conf.write_text("port: 4222\n" + authorization_block("pdserve", refs))
    env = {f"PDSERVE_NATS_{role.upper()}_PASSWORD": f"pw-{role}" for role in ROLES}
    assert nats_config_test(conf, env).returncode == 0
    missing = nats_config_test(conf, {})
    assert missing.returncode != 0 and "PDSERVE_NATS_GATEWAY_PASSWORD" in missing.stderr


@pytest.mark.skipif(KUBECTL is None, reason="kubectl renders the manifests")
def test_kubernetes_nats_nodes_run_roles_conf_with_the_passwords(tmp_path: Path) -> None:
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
    done = nats_config_test(tmp_path / "roles.conf", {**passwords, "POD_NAME": "nats-0"})
    assert done.returncode == 0, done.stderr
