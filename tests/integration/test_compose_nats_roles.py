"""NATS users per role in compose (``NATS_CONFIG=roles`` / ``cluster-roles``) and Kubernetes,
checked without docker: the committed configs are what shared/bus/roles.py writes, nats-server
accepts them (``-t``) with the passwords in its environment and refuses them without, and each
pdserve service logs in as its own role.

``python -m tests.integration.test_compose_nats_roles`` writes the compose files again."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdserve.services.control.processes import find_nats_server
from pdserve.shared.bus.roles import ROLES, authorization_block
from tests.integration.test_compose import (
    COMPOSE_DIR,
    environment_of,
    interpolate,
    load_raw,
    pdserve_command,
    pdserve_services,
)

# config name under /etc/nats -> (file in compose/, the config it adds users to)
ROLE_CONFIGS = {
    "roles": ("nats-roles.conf", "./pdserve.conf"),
    "cluster-roles": ("nats-cluster-roles.conf", "./cluster.conf"),
}
PASSWORDS = {f"NATS_{role.upper()}_PASSWORD": f"pw-{role}" for role in ROLES}


def role_config(name: str) -> str:
    _, base = ROLE_CONFIGS[name]
    refs = {role: f"$NATS_{role.upper()}_PASSWORD" for role in ROLES}
    return (
        f"# NATS with one user per pdserve role (NATS_CONFIG={name} in .env): each role may\n"
        "# publish and subscribe only on its own subjects (docs/security.md). nats-server reads\n"
        "# the passwords from its environment (the NATS_<ROLE>_PASSWORD lines of .env) and\n"
        "# refuses to start without them. Written by\n"
        "# `python -m tests.integration.test_compose_nats_roles` from shared/bus/roles.py, for the\n"
        "# default namespace (pdserve).\n"
        f"include {base}\n\n" + authorization_block("pdserve", refs)
    )


@pytest.mark.parametrize("name", sorted(ROLE_CONFIGS))
def test_committed_role_configs_are_what_roles_py_writes(name: str) -> None:
    path = COMPOSE_DIR / ROLE_CONFIGS[name][0]
    assert path.read_text() == role_config(name), f"run python -m {__name__}"


def etc_nats(dotenv: dict[str, str], service: str, into: Path) -> Path:
    """The config ``service`` runs, in a copy of its /etc/nats (the mounts, by container
    name: the configs include each other by those names)."""
    node = interpolate(load_raw(), dotenv)["services"][service]
    for volume in node["volumes"]:
        source, target = str(volume).split(":")[:2]
        if target.startswith("/etc/nats/"):
            (into / Path(target).name).write_text((COMPOSE_DIR / source).read_text())
    args = node["command"][1:]
    return into / Path(args[args.index("--config") + 1]).name


@pytest.mark.parametrize(
    ("config", "service"),
    [("roles", "nats"), ("cluster-roles", "nats"), ("cluster-roles", "nats-2")],
)
def test_nats_accepts_the_role_config_with_passwords_only(
    tmp_path: Path, config: str, service: str
) -> None:
    conf = etc_nats({"NATS_CONFIG": config, **PASSWORDS}, service, tmp_path)
    assert conf.read_text() == role_config(config)
    test = [find_nats_server(), "-t", "-c", str(conf)]
    ok = subprocess.run(test, env=PASSWORDS, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    # the file's nodes pass the passwords through from .env: without them, no server at all
    env = interpolate(load_raw(), {})["services"][service]["environment"]
    assert set(PASSWORDS) <= set(env) and all(env[k] is None for k in PASSWORDS)
    bare = subprocess.run(test, env={}, capture_output=True, text=True, timeout=30)
    assert bare.returncode != 0 and "NATS_" in bare.stderr


def test_each_pdserve_service_logs_in_as_its_role() -> None:
    doc = interpolate(load_raw(), {"NATS_CONFIG": "roles", **PASSWORDS})
    seen = set()
    for name, service in pdserve_services(doc).items():
        role = pdserve_command(service)[1]
        env = environment_of(service)
        assert env["PDSERVE_NATS_USER"] == role, name
        assert env["PDSERVE_NATS_PASSWORD"] == PASSWORDS[f"NATS_{role.upper()}_PASSWORD"], name
        seen.add(role)
    assert seen == {"gateway", "prefill", "decode"}


def test_without_roles_the_services_present_no_user() -> None:
    """The default (loopback NATS, or PDSERVE_NATS_TOKEN) is unchanged: an empty user is none."""
    doc = interpolate(load_raw(), {})
    for name, service in pdserve_services(doc).items():
        env = environment_of(service)
        assert env["PDSERVE_NATS_USER"] == "" and env["PDSERVE_NATS_PASSWORD"] == "", name


if __name__ == "__main__":
    for config_name, (file_name, _) in ROLE_CONFIGS.items():
        (COMPOSE_DIR / file_name).write_text(role_config(config_name))
