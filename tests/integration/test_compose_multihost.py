"""The multi-host deployment (compose/multihost/): one compose file per role, checked offline.

Each host runs one role file with the same hosts.env, only THIS_HOST differing. For each role,
as its own host would run it, the file must match the Compose Specification, run real
`pdserve` commands with options they read, and wire the cluster: NATS listens and routes on the
host's own address to all three nodes, every client lists all three nodes with its own first,
workers bind UCX to their own host's address, and nothing relies on loopback. Where
docker-compose is installed, its own `config` must accept each file too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_compose import (
    LOOPBACK,
    SCHEMA,
    command_options,
    environment_of,
    interpolate,
    parse_with_env,
    pdserve_command,
    read_dotenv,
    role_of,
)

MULTIHOST = Path(__file__).resolve().parents[2] / "compose" / "multihost"
HOSTS_ENV = MULTIHOST / "hosts.env.example"
ROLES = {"gateway": "GATEWAY_HOST", "prefill": "PREFILL_HOST", "decode": "DECODE_HOST"}


def host_env(role: str) -> dict[str, str]:
    env = read_dotenv(HOSTS_ENV).values
    return {**env, "THIS_HOST": env[ROLES[role]]}


def load_role(role: str) -> dict[str, Any]:
    """The role file as its host runs it, with `extends` from common.yml resolved."""
    env = host_env(role)
    doc = interpolate(yaml.safe_load((MULTIHOST / f"{role}.yml").read_text()), env)
    common = interpolate(yaml.safe_load((MULTIHOST / "common.yml").read_text()), env)

    def resolve(service: dict[str, Any]) -> dict[str, Any]:
        ext = service.get("extends")
        if not ext:
            return service
        ext = {"service": ext} if isinstance(ext, str) else ext  # same-file shorthand
        assert ext.get("file", "common.yml") == "common.yml", ext
        base = resolve(dict(common["services"][ext["service"]]))
        own = {k: v for k, v in service.items() if k != "extends"}
        merged = {**base, **own}
        merged["environment"] = {**environment_of(base), **environment_of(own)}
        return merged

    doc["services"] = {name: resolve(s) for name, s in doc["services"].items()}
    return doc


@pytest.mark.parametrize("role", [*ROLES, "common"])
def test_role_files_match_the_compose_specification(role: str) -> None:
    if not SCHEMA.is_file():
        pytest.skip(f"Compose Specification schema not present at {SCHEMA}")
    jsonschema = pytest.importorskip("jsonschema")
    env = host_env("gateway" if role == "common" else role)
    doc = interpolate(yaml.safe_load((MULTIHOST / f"{role}.yml").read_text()), env)
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]
    assert not errors, f"{role}.yml:\n" + "\n".join(errors)


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


@pytest.mark.parametrize("role", list(ROLES))
def test_each_host_joins_the_cluster_on_its_own_address(role: str) -> None:
    env = host_env(role)
    hosts = {env[var] for var in ROLES.values()}
    assert len(hosts) == 3 and not hosts & set(LOOPBACK), hosts
    me = env["THIS_HOST"]
    services = load_role(role)["services"]

    nats = services["nats"]["command"]
    assert nats[0] == "nats-server"
    assert flag(nats, "--addr") == me, "NATS must listen where the other hosts reach it"
    assert flag(nats, "--auth"), "NATS leaves the host: clients must present a token"
    assert flag(nats, "--cluster").endswith(f"@{me}:6222")
    routes = {r.rsplit("@", 1)[1] for r in flag(nats, "--routes").split(",")}
    assert routes == {f"{h}:6222" for h in hosts}, routes
    assert services["nats"]["network_mode"] == "host"

    roles_here = set()
    for name, service in services.items():
        command = pdserve_command(service)
        if not command:
            continue
        kind = role_of(name, service)
        roles_here.add(kind)
        own = environment_of(service)
        options = command_options(kind)
        for key in own:
            if key.startswith("PDSERVE_"):
                assert key.removeprefix("PDSERVE_").lower() in options, f"{name}: {key}"
        parse_with_env(command, {k: v for k, v in own.items() if k.startswith("PDSERVE_")})
        assert service["network_mode"] == "host", name
        urls = own["PDSERVE_NATS_URL"].split(",")
        assert urls[0] == f"nats://{me}:4222", f"{name}: connect to this host's node first"
        assert {u.removeprefix("nats://") for u in urls} == {f"{h}:4222" for h in hosts}
        if kind != "gateway":
            assert own["PDSERVE_UCX_HOST"] == me, f"{name}: UCX must bind this host's address"
            assert me in own["PDSERVE_WORKER_ID"], f"{name}: worker ids unique across hosts"
            assert service.get("ipc") == "host" and service["ulimits"]["memlock"] == -1
        for value in own.values():
            assert not any(f"//{lo}" in value for lo in LOOPBACK), f"{name}: {value}"
    assert roles_here == {role}


@pytest.mark.parametrize("role", list(ROLES))
def test_docker_compose_accepts_the_role_files(role: str, tmp_path: Path) -> None:
    cli = shutil.which("docker-compose")
    if not cli:
        pytest.skip("docker-compose is not installed")
    env_file = tmp_path / "hosts.env"
    env = host_env(role)
    env["SERVICE_ENV_FILE"] = str(env_file)
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    done = subprocess.run(
        [cli, "--env-file", str(env_file), "-f", str(MULTIHOST / f"{role}.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
