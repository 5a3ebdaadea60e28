"""A docker engine and compose CLI for the docker test tier, or the reason there is none.

`docker_engine()` finds a running engine, or starts `dockerd` (as root) with its bridge and its
address pools on link-local subnets, and stops it again afterwards. Every skip reason names what
is missing, so that `make test` on a machine without docker says why in seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.docker.image import IMAGE, is_current, rebuild

# Link-local only (169.254.0.0/16): traffic towards private ranges is flagged where this runs.
DOCKERD_BRIDGE = "169.254.77.1/24"
DOCKERD_POOL = "base=169.254.96.0/20,size=24"


class NoDocker(Exception):
    """Why the tier cannot run here (the skip reason)."""


@dataclasses.dataclass
class Engine:
    compose: list[str]  # ["docker", "compose"] or ["docker-compose"]
    started_pid: int | None  # the dockerd this tier started, if any


def docker(*args: str, timeout: float = 60, check: bool = True) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip()


def engine_answers() -> bool:
    try:
        return (
            subprocess.run(
                ["docker", "info", "--format", "{{.ID}}"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_dockerd(log: Path) -> int:
    if os.geteuid() != 0:
        raise NoDocker("no docker engine answers, and starting dockerd needs root")
    dockerd = shutil.which("dockerd")
    if not dockerd:
        raise NoDocker(
            "no docker engine answers and dockerd is not installed (apt install docker.io)"
        )
    argv = [dockerd, "--bip", DOCKERD_BRIDGE, "--default-address-pool", DOCKERD_POOL]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while not engine_answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_dockerd(proc.pid)
            raise NoDocker(f"dockerd did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.5)
    return proc.pid


def stop_dockerd(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def compose_cli() -> list[str]:
    """The v2 plugin where there is one, else docker-compose 1.x; both read the same file."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        if (
            subprocess.run(
                ["docker", "compose", "version"], capture_output=True, timeout=10
            ).returncode
            == 0
        ):
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise NoDocker(
        "no compose CLI: neither `docker compose` nor `docker-compose` (apt install docker-compose)"
    )


@contextlib.contextmanager
def docker_engine(log: Path) -> Iterator[Engine]:
    if not shutil.which("docker"):
        raise NoDocker("the docker CLI is not installed (apt install docker.io)")
    compose = compose_cli()
    started = None if engine_answers() else start_dockerd(log)
    try:
        if not docker("images", "-q", IMAGE, check=False):
            raise NoDocker(f"image {IMAGE} is not built: run `make image` (compose/build-image.sh)")
        if not is_current("docker"):
            why = rebuild(log.with_name("make-image.log"))
            if why is not None:
                raise NoDocker(
                    f"image {IMAGE} is from another tree, and rebuilding it failed: {why}"
                )
        yield Engine(compose, started)
    finally:
        if started is not None:
            stop_dockerd(started)
