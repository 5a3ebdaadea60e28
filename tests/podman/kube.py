"""The Kubernetes CPU overlay as `podman kube play` can run it, or the reason it cannot run here.

`podman kube play` (Debian's podman 4.3) runs Pods, Deployments (one pod per replica),
ConfigMaps and PersistentVolumeClaims (as named volumes) without a cluster. What it cannot run is
changed or left out here, each for the reason in `CHANGES`; the rendered overlay is otherwise
used as it is (commands, settings, security contexts, volumes, the NATS cluster's routes).

Every skip reason names what is missing, so that a run without podman or the image says why in
seconds.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.docker.image import IMAGE, is_current

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "compose" / "kubernetes" / "overlays" / "cpu"
# Not 10/8, 172.16/12 or 192.168/16 (traffic to those is flagged where this runs), and not
# link-local: UCX's TCP transport leaves link-local interfaces out. 198.18.0.0/15 is the
# benchmarking range the multihost tier uses too.
SUBNET_PREFIX = "198.18.{}"
# Debian's podman on this kind of machine: the default nofile ulimit cannot be raised in the
# sandbox, and crun is not installed; runc is.
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n'

# What podman kube play cannot do with the rendered overlay, and what stands in for it.
CHANGES = {
    "StatefulSet": "podman 4.3 has no StatefulSet: nats becomes Pods nats-0..2 from its template",
    "Service": "no cluster DNS or kube-proxy: each pod gets hostAliases for nats-N.nats; "
    "the test reaches the gateway and the workers at their pod IPs",
    "PodDisruptionBudget": "no eviction API without a cluster (checked by the unit tier)",
    "NetworkPolicy": "enforced by a CNI plugin; podman's netavark has none (unit tier)",
    "Namespace": "podman has no namespaces",
    "status.podIP": "not in podman's downward API: PDSERVE_UCX_HOST takes metadata.name, the "
    "pod's name, which /etc/hosts of the pod maps to its IP",
    "probes": "podman 4.3 runs httpGet probes as curl (not in the image) against localhost "
    "(the workers listen on the pod IP) and ignores readiness: the test asks the same paths "
    "and ports itself",
    "ports": "podman 4.3 publishes a containerPort on the host (three NATS pods cannot all "
    "have 4222 there): left out, every port is reached at its pod's IP as in a cluster",
    "lifecycle": "preStop hooks are not run by podman 4.3 (NATS's lame duck, the gateway's 5 s)",
    "hostPath": "the model directory is a temporary directory instead of /var/lib/pdserve/model",
}


class NoPodman(Exception):
    """Why the tier cannot run here (the skip reason)."""


class Podman:
    def __init__(self, workdir: Path) -> None:
        conf = workdir / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        done = subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout.strip()

    def logs(self, container: str, tail: int) -> str:
        """What the container wrote, stdout and stderr together (pdserve logs to stderr)."""
        done = subprocess.run(
            ["podman", "logs", "--tail", str(tail), container],
            env=self.env,
            timeout=60,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        return done.stdout

    def ip_of(self, pod: str, network: str) -> str:
        infra = self("pod", "inspect", pod, "--format", "{{.InfraContainerID}}")
        fmt = f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}'
        return self("inspect", infra, "--format", fmt)


def find_podman(workdir: Path) -> Podman:
    if not shutil.which("podman"):
        raise NoPodman("podman is not installed (apt install podman runc)")
    if not shutil.which("kubectl"):
        raise NoPodman("kubectl is not installed (it renders the overlay: kubectl kustomize)")
    podman = Podman(workdir)
    try:
        podman("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=30)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise NoPodman(f"podman does not work here: {exc}") from None
    if not _exists(podman):
        raise NoPodman(
            f"image {IMAGE} is not in podman's storage: run `make image` (with podman "
            f"installed it loads the image there too), or `docker save {IMAGE} | podman load`"
        )
    if not is_current("podman", podman.env):
        _refresh(podman, workdir)
    return podman


def _refresh(podman: Podman, workdir: Path) -> None:
    """Podman's copy of the image was built from another tree: docker rebuilds it if its own is
    stale too (`make image` loads it here), else its current one is copied over."""
    from tests.docker.engine import NoDocker, docker_engine

    try:
        with docker_engine(workdir / "dockerd.log"):
            if not is_current("podman", podman.env):
                subprocess.run(
                    ["sh", "-c", 'docker save "$1" | podman load', "sh", IMAGE],
                    env=podman.env,
                    capture_output=True,
                    timeout=900,
                    check=True,
                )
    except (NoDocker, subprocess.SubprocessError) as exc:
        raise NoPodman(
            f"image {IMAGE} is from another tree and could not be rebuilt: {exc}"
        ) from None
    if not is_current("podman", podman.env):
        raise NoPodman(
            f"image {IMAGE} in podman's storage is still from another tree after a rebuild"
        )


def _exists(podman: Podman) -> bool:
    done = subprocess.run(["podman", "image", "exists", IMAGE], env=podman.env, timeout=30)
    return done.returncode == 0


def render() -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAY)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _strip_pod(spec: dict[str, Any], aliases: list[dict[str, Any]], model_dir: Path) -> None:
    spec["hostAliases"] = aliases
    for c in spec["containers"]:
        for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports"):
            c.pop(key, None)
        for var in c.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("fieldRef") or {}
            if ref.get("fieldPath") == "status.podIP":
                ref["fieldPath"] = "metadata.name"
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            volume["hostPath"] = {"path": str(model_dir), "type": "Directory"}


def for_podman(
    objects: list[dict[str, Any]],
    nats_ips: list[str],
    model_dir: Path,
    replicas: dict[str, int],
    prefix: str = "",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(NATS pods, everything else) for two `podman kube play` calls: NATS first, on the static
    addresses its hostAliases name (pods named ``prefix`` + nats-N). ``replicas`` overrides Deployments' counts (the migration
    and drain checks need two of each worker). Claims become podman volumes of the same name
    (podman 4.3 refuses to play a claim whose volume exists: the caller names them per run)."""
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    service = statefulset["spec"]["serviceName"]
    names = [f"{statefulset['metadata']['name']}-{i}" for i in range(len(nats_ips))]
    aliases = [
        {"ip": ip, "hostnames": [f"{n}.{service}"]} for n, ip in zip(names, nats_ips, strict=True)
    ]
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    nats_pods = []
    for name in names:
        template = copy.deepcopy(statefulset["spec"]["template"])
        _strip_pod(template["spec"], aliases, model_dir)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": prefix + name, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
        nats_pods.append(pod)
    rest: list[dict[str, Any]] = []
    for obj in objects:
        if obj["kind"] == "Deployment":
            obj = copy.deepcopy(obj)
            obj["spec"]["replicas"] = replicas.get(obj["metadata"]["name"], 1)
            _strip_pod(obj["spec"]["template"]["spec"], aliases, model_dir)
            rest.append(obj)
        elif obj["kind"] == "PersistentVolumeClaim":
            rest.append(obj)
    return [*maps, *nats_pods], [*maps, *rest]


def dump(objects: list[dict[str, Any]], path: Path) -> Path:
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path
