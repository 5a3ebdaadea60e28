"""docker compose, run for real: the CPU profile from the built image, on a link-local network.

Needs a docker engine (started here as root if none answers), a compose CLI (v2 plugin or
docker-compose 1.29) and the image from `make image`; skips in seconds, saying which is missing.
The image is built by `make image`, not here: a cold build downloads ~300 MB of wheels and takes
minutes, a warm `make image` takes seconds, and the tier itself then takes about two minutes.

It runs `compose --profile cpu up` under a unique project name, waits for every health check,
streams a chat completion through the gateway and compares it with the same request served by
`pdserve up` (greedy, the same default model, SmolLM2-135M-Instruct: the same text; the services
converted it once, into the shared cache volume, and UCX warned of no unused variable), then
crashes the decode worker and checks that its restart policy brings it back to serve again.
Containers, networks and volumes of the project are removed at the end, also when a step fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.services.control.processes import free_port
from tests.docker.engine import IMAGE, Engine, NoDocker, docker, docker_engine

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
SERVICES = ("nats", "gateway", "prefill-cpu", "decode-cpu")
PROJECT_PREFIX = "pdtest"
CHAT = {
    "messages": [{"role": "user", "content": "Which way to the harbour?"}],
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}

pytestmark = pytest.mark.slow


@dataclass
class ComposeStack:
    engine: Engine
    project: str
    env: dict[str, str]
    gateway_url: str
    env_file: Path  # empty: a developer's compose/.env plays no part
    ready_seconds: float = 0.0  # from `up` to every health check passing

    def compose(self, *args: str, timeout: float = 180) -> str:
        argv = [*self.engine.compose, "-f", str(COMPOSE_FILE), "-p", self.project]
        argv += ["--env-file", str(self.env_file), *args]
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def container(self, service: str) -> str:
        found = docker(
            "ps",
            "-aq",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        )
        assert found, f"no container for {service}"
        return found.splitlines()[0]

    def health(self, service: str) -> str:
        return docker("inspect", "-f", "{{.State.Health.Status}}", self.container(service))

    def logs(self) -> str:
        with contextlib.suppress(Exception):
            return self.compose("logs", "--no-color", "--tail", "60", timeout=60)
        return "(no logs)"


def wait_healthy(stack: ComposeStack, services: tuple[str, ...], timeout: float) -> float:
    start = time.monotonic()
    while True:
        states = {s: stack.health(s) for s in services}
        if all(v == "healthy" for v in states.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not healthy after {timeout:.0f} s: {states}\n{stack.logs()}")
        time.sleep(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("docker")
    try:
        engine_cm = docker_engine(logs / "dockerd.log")
        found = engine_cm.__enter__()
    except NoDocker as why:
        pytest.skip(f"docker tier: {why}")
    try:
        remove_orphaned_projects()
        yield found
    finally:
        engine_cm.__exit__(None, None, None)


def new_stack(engine: Engine, workdir: Path) -> ComposeStack:
    """A project of its own: unique name, free host ports, a random link-local /24, so that
    parallel runs cannot collide. The name carries this process's pid: what a killed run left
    behind is removed by the next (remove_orphaned_projects)."""
    name, tag = IMAGE.rsplit(":", 1)
    project = f"{PROJECT_PREFIX}{os.getpid()}x{uuid.uuid4().hex[:6]}"
    empty_env = workdir / "empty.env"
    empty_env.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    env.update(
        IMAGE_NAME=name,
        IMAGE_TAG=tag.removesuffix("-cpu"),
        GATEWAY_PORT=str(free_port()),
        NATS_PORT=str(free_port()),
        NATS_MONITOR_PORT=str(free_port()),
        # The CPU workers use the host's network (bound to 127.0.0.1): free metrics ports.
        CPU_PREFILL_METRICS_PORT=str(free_port()),
        CPU_DECODE_METRICS_PORT=str(free_port()),
        COMPOSE_SUBNET=f"169.254.{random.randint(100, 250)}.0/24",
    )
    url = f"http://127.0.0.1:{env['GATEWAY_PORT']}"
    return ComposeStack(engine, project, env, url, empty_env)


@pytest.fixture(scope="module")
def compose_stack(engine: Engine, tmp_path_factory) -> Iterator[ComposeStack]:
    stack = new_stack(engine, tmp_path_factory.mktemp("compose"))
    try:
        stack.compose("--profile", "cpu", "up", "-d", "--no-build")
        stack.ready_seconds = wait_healthy(stack, SERVICES, timeout=240)
        yield stack
    finally:
        with contextlib.suppress(Exception):
            stack.compose("--profile", "cpu", "down", "-v", "--remove-orphans", "-t", "20")
        remove_project(stack.project)


def remove_project(project: str) -> None:
    """Every container and network labelled with the compose project, whatever compose did."""
    label = f"label=com.docker.compose.project={project}"
    for cid in docker("ps", "-aq", "--filter", label, check=False).split():
        docker("rm", "-f", "-v", cid, check=False)
    for net in docker("network", "ls", "-q", "--filter", label, check=False).split():
        docker("network", "rm", net, check=False)


def remove_orphaned_projects() -> None:
    """Projects of test runs whose process is gone (killed before its finalizers ran)."""
    fmt = '{{.Label "com.docker.compose.project"}}'
    projects = set(docker("ps", "-a", "--format", fmt, check=False).split())
    for project in projects:
        pid = project.removeprefix(PROJECT_PREFIX).split("x")[0]
        if (
            project.startswith(PROJECT_PREFIX)
            and pid.isdigit()
            and not Path(f"/proc/{pid}").exists()
        ):
            remove_project(project)


def stream_chat(base_url: str, model: str) -> tuple[str, str]:
    """(text, finish reason) of a streamed chat completion, read chunk by chunk."""
    body = json.dumps({**CHAT, "model": model}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    text, finish = [], None
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.headers.get_content_type() == "text/event-stream"
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "choices" in chunk, chunk  # an error event: say which
            choice = chunk["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def crash_worker(stack: ComposeStack, service: str) -> None:
    """SIGKILL the pdserve process under the container's init, as a crash or OOM kill would.

    `docker kill` is not used: docker counts it as a manual stop, after which neither
    `unless-stopped` nor `always` restarts the container (seen on Engine 20.10)."""
    init_pid = int(docker("inspect", "-f", "{{.State.Pid}}", stack.container(service)))
    children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    assert children, f"{service}: its init has no child"
    os.kill(int(children[0]), signal.SIGKILL)


def test_cluster_profile_meshes_three_nats_nodes(engine: Engine, tmp_path: Path) -> None:
    """The "cluster" profile: node 1 takes the cluster's config (NATS_CONFIG=cluster), and the
    three nodes route to each other."""
    stack = new_stack(engine, tmp_path)
    stack.env["NATS_CONFIG"] = "cluster"
    nodes = ("nats", "nats-2", "nats-3")
    try:
        stack.compose("--profile", "cluster", "up", "-d", "--no-build", *nodes)
        wait_healthy(stack, nodes, timeout=60)
        routez = f"http://127.0.0.1:{stack.env['NATS_MONITOR_PORT']}/routez"
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(routez, timeout=5) as resp:
                routes = json.loads(resp.read())
            peers = {r.get("remote_name") for r in routes.get("routes") or []}
            if peers >= {"nats-2", "nats-3"}:
                break
            assert time.monotonic() < deadline, f"node 1 routes only to {peers}\n{stack.logs()}"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(Exception):
            stack.compose("--profile", "cluster", "down", "-v", "-t", "5")
        remove_project(stack.project)


def test_cpu_profile_runs_in_docker(compose_stack: ComposeStack, tmp_path: Path) -> None:
    from tests.integration.stack import pdserve_up

    stack = compose_stack
    model = served_model(stack.gateway_url)
    assert model == "smollm2-135m-instruct"  # MODEL unset: the default model, not the demo one
    text, finish = stream_chat(stack.gateway_url, model)
    assert finish == "length" and text, (text, finish)
    # Every service converted nothing or found the copy another made (one shared volume), and
    # UCX found no variable it does not read (issue 31: each worker warned once).
    logs = stack.compose("logs", "--no-color", timeout=60)
    assert logs.count("(first load of this file)") == 1, logs
    assert "unused environment variable" not in logs, logs

    # The same default model served by `pdserve up`, on the host: greedy output is the same.
    port = free_port()
    with pdserve_up(["--port", str(port)], tmp_path / "up.log"):
        reference, ref_finish = stream_chat(
            f"http://127.0.0.1:{port}", served_model(f"http://127.0.0.1:{port}")
        )
    assert (text, finish) == (reference, ref_finish)

    # A crashed decode worker comes back by its restart policy and serves again.
    decode = stack.container("decode-cpu")
    restarts = int(docker("inspect", "-f", "{{.RestartCount}}", decode))
    crash_worker(stack, "decode-cpu")
    deadline = time.monotonic() + 120
    while int(docker("inspect", "-f", "{{.RestartCount}}", decode)) == restarts:
        assert time.monotonic() < deadline, f"decode-cpu never restarted\n{stack.logs()}"
        time.sleep(0.5)
    wait_healthy(stack, SERVICES, timeout=120)
    deadline = time.monotonic() + 60
    while True:
        try:
            again, _ = stream_chat(stack.gateway_url, model)
            break
        except OSError:  # the gateway answers 503 until the new worker has announced itself
            assert time.monotonic() < deadline, f"not served after the restart\n{stack.logs()}"
            time.sleep(1)
    assert again == text
