"""The Kubernetes CPU overlay, run for real under `podman kube play` (no cluster).

Needs podman (Debian's, with runc), kubectl (to render the overlay) and the image from
`make image` in podman's storage; skips in seconds, saying which is missing. The overlay is
rendered with `kubectl kustomize` and played as it is, except for what podman cannot run
(tests/podman/kube.py, CHANGES: the NATS StatefulSet becomes three Pods, Services and policies
are left out, the test asks the probes' paths itself). Two prefill and two decode replicas, so
that a pod can go while its work continues elsewhere.

Checks: every pod becomes ready (its own readiness path and port); the default model was
converted once, into the shared cache claim; a streamed chat completion through the gateway
equals `pdserve up`'s (greedy, the same default model); killing a decode pod moves its streams,
which end as an undisturbed run does; stopping a prefill pod (SIGTERM, then the grace period)
while decode workers still pull its KV fails no stream and recomputes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.services.control.processes import free_port
from tests.podman.kube import CHANGES, NoPodman, Podman, dump, find_podman, for_podman, render

# Pods start in about a minute; the fixture alone may take longer than the default per-test limit.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PREFIX = "pdtest"
REPLICAS = {"gateway": 1, "prefill": 2, "decode": 2}
CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 12,
    "temperature": 0,
    "stream": True,
}


@dataclass
class Cluster:
    podman: Podman
    project: str
    network: str
    pods: dict[str, str] = field(default_factory=dict)  # pod name -> IP
    probes: dict[str, tuple[str, int]] = field(default_factory=dict)  # pod -> (path, port)
    ready_seconds: float = 0.0

    def role_pods(self, role: str) -> list[str]:
        return sorted(p for p in self.pods if p.startswith(f"{self.project}-{role}-pod-"))

    @property
    def gateway(self) -> str:
        return f"http://{self.pods[self.role_pods('gateway')[0]]}:8000"

    def url(self, pod: str, port: int = 9100) -> str:
        return f"http://{self.pods[pod]}:{port}"

    def ready(self, pod: str) -> tuple[int, dict]:
        path, port = self.probes[pod]
        return get_json(self.url(pod, port) + path)

    def logs(self, tail: int = 40) -> str:
        out = []
        for pod in self.pods:
            for name in self.podman(
                "ps", "-a", "--pod", "--filter", f"pod={pod}", "--format", "{{.Names}}", check=False
            ).split():
                if not name.endswith("-infra"):
                    text = self.podman.logs(name, tail)
                    out.append(f"--- {name}\n{text}")
        return "\n".join(out)


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            body = r.read()
            return r.status, json.loads(body) if body[:1] in (b"{", b"[") else {}
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(ValueError):
            return exc.code, json.loads(exc.read())
        return exc.code, {}
    except OSError:
        return 0, {}


def metric_sum(url: str, name: str) -> float:
    from tests.integration.migration_stack import metric

    return sum(metric(url, name).values())


def readiness_probes(objects: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """Deployment or StatefulSet name -> the (path, port) of its container's readinessProbe."""
    out = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            (c,) = obj["spec"]["template"]["spec"]["containers"]
            probe = c["readinessProbe"]["httpGet"]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            out[obj["metadata"]["name"]] = (probe["path"], ports.get(probe["port"], probe["port"]))
    return out


def remove(podman: Podman, project: str) -> None:
    """Every pod, volume and network of ``project``, whatever state they are in."""
    for pod in podman("pod", "ps", "--format", "{{.Name}}", check=False).split():
        if pod.startswith(f"{project}-"):
            podman("pod", "rm", "-f", "-t", "0", pod, check=False, timeout=120)
    for vol in podman("volume", "ls", "--format", "{{.Name}}", check=False).split():
        if vol.startswith(f"{project}-"):
            podman("volume", "rm", "-f", vol, check=False)
    podman("network", "rm", "-f", project, check=False)
    # podman 4.3 keeps a configMap volume as a named volume called after the ConfigMap; another
    # run's pods may still use it (then it stays).
    for obj in render():
        if obj["kind"] == "ConfigMap":
            podman("volume", "rm", obj["metadata"]["name"], check=False)


def remove_orphans(podman: Podman) -> None:
    """Projects of test runs whose process is gone (killed before the finalizer ran)."""
    for net in podman("network", "ls", "--format", "{{.Name}}", check=False).split():
        pid = net.removeprefix(PREFIX).split("x")[0]
        if net.startswith(PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove(podman, net)


def play(tmp: Path, podman: Podman, project: str) -> Cluster:
    cluster = Cluster(podman, project, project)
    for attempt in range(5):  # a /24 another run (or the multihost tier) holds is refused
        net = f"198.18.{random.randint(2, 250)}"
        try:
            podman("network", "create", "--subnet", f"{net}.0/24", project)
            break
        except RuntimeError:
            if attempt == 4:
                raise
    objects = render()
    probes = readiness_probes(objects)
    for obj in objects:  # pod and volume names are global in podman: make them this run's
        if obj["kind"] in ("Deployment", "PersistentVolumeClaim"):
            obj["metadata"]["name"] = f"{project}-{obj['metadata']['name']}"
        for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]
                claim["claimName"] = f"{project}-{claim['claimName']}"
    model_dir = tmp / "model"
    model_dir.mkdir()
    nats_ips = [f"{net}.{11 + i}" for i in range(3)]
    replicas = {f"{project}-{k}": v for k, v in REPLICAS.items()}
    nats, rest = for_podman(objects, nats_ips, model_dir, replicas, prefix=f"{project}-")
    nats_file, rest_file = dump(nats, tmp / "nats.yaml"), dump(rest, tmp / "pdserve.yaml")
    ips = [a for ip in nats_ips for a in ("--ip", ip)]
    podman("kube", "play", "--network", project, *ips, str(nats_file), timeout=300)
    podman("kube", "play", "--network", project, str(rest_file), timeout=300)
    for pod in podman("pod", "ps", "--format", "{{.Name}}").split():
        if pod.startswith(f"{project}-"):
            cluster.pods[pod] = podman.ip_of(pod, project)
            owner = pod.removeprefix(f"{project}-").rsplit("-pod-", 1)[0]
            owner = owner.rsplit("-", 1)[0] if owner.startswith("nats-") else owner
            cluster.probes[pod] = probes[owner]
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("podman")
    try:
        podman = find_podman(tmp)
    except NoPodman as why:
        pytest.skip(f"podman tier: {why}")
    remove_orphans(podman)
    started = time.monotonic()
    project = f"{PREFIX}{os.getpid()}x{uuid.uuid4().hex[:6]}"
    try:
        found = play(tmp, podman, project)
        deadline = time.monotonic() + 900
        while True:
            states = {pod: found.ready(pod)[0] for pod in found.pods}
            if all(code == 200 for code in states.values()):
                break
            assert time.monotonic() < deadline, f"not ready: {states}\n{found.logs()}"
            print(f"not ready yet: {states}", flush=True)
            time.sleep(2)
        found.ready_seconds = time.monotonic() - started
        yield found
    finally:
        remove(podman, project)


def test_every_pod_becomes_ready_and_the_model_is_converted_once(cluster: Cluster) -> None:
    roles = {"nats": 3, **REPLICAS}
    for role, count in roles.items():
        got = [p for p in cluster.pods if p.removeprefix(f"{cluster.project}-").startswith(role)]
        assert len(got) == count, (role, sorted(cluster.pods))
    assert all(cluster.ready(pod)[0] == 200 for pod in cluster.pods)
    print(f"every pod ready {cluster.ready_seconds:.0f} s after kube play; ignored: {CHANGES}")
    # Every pdserve pod loads the default model; one converted it into the shared claim.
    logs = cluster.logs(tail=100_000)
    assert logs.count("(first load of this file)") == 1, logs
    # pdserve sets no UCX variable that UCX does not read (issue 31: each worker warned once).
    assert "unused environment variable" not in logs, logs
    _, models = get_json(f"{cluster.gateway}/v1/models")
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"], models


def stream_chat(base: str) -> tuple[str, str | None]:
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        json.dumps({**CHAT, "model": "smollm2-135m-instruct"}).encode(),
        {"Content-Type": "application/json"},
    )
    text, finish = [], None
    with urllib.request.urlopen(request, timeout=180) as resp:
        assert resp.headers.get_content_type() == "text/event-stream"
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def test_streamed_chat_equals_pdserve_up(cluster: Cluster, tmp_path: Path) -> None:
    from tests.integration.stack import pdserve_up

    text, finish = stream_chat(cluster.gateway)
    assert text and finish in ("stop", "length"), (text, finish)
    port = free_port()
    with pdserve_up(["--port", str(port)], tmp_path / "up.log", timeout=600):
        reference = stream_chat(f"http://127.0.0.1:{port}")
    print(f"kube play: {text!r}; pdserve up: {reference[0]!r}")
    assert (text, finish) == reference


def completion(i: int, max_tokens: int) -> dict:
    prompt = f"{i}: Paged attention keeps the keys and values of every token in blocks. " * 4
    return {
        "model": "smollm2-135m-instruct",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def run_all(base: str, bodies: dict[str, dict], out: dict) -> None:
    from tests.integration.migration_stack import Stream, stream

    async with aiohttp.ClientSession() as session:

        async def one(rid: str, body: dict) -> None:
            await stream(session, base, rid, body, out.setdefault(rid, Stream()))

        await asyncio.gather(*(one(rid, b) for rid, b in bodies.items()))


def assert_same(got: dict, reference: dict) -> None:
    for rid, want in reference.items():
        out = got[rid.removeprefix("ref-")]
        assert out.error is None and out.done, (rid, out.error)
        assert out.finish == want.finish == {0: "length"}, rid
        assert dict(out.texts) == dict(want.texts), rid


async def test_killing_a_decode_pod_migrates_its_streams(cluster: Cluster) -> None:
    from tests.integration.migration_stack import DecodeSpy, migrations, until

    bodies = {f"kd-{i}": completion(i, 48) for i in range(4)}
    reference: dict = {}
    await run_all(cluster.gateway, {f"ref-{r}": b for r, b in bodies.items()}, reference)
    nats = next(p for p in cluster.pods if "-nats-" in p)
    spy = await DecodeSpy().start(f"nats://{cluster.pods[nats]}:4222")
    try:
        results: dict = {}
        task = asyncio.create_task(run_all(cluster.gateway, bodies, results))
        await until(
            lambda: (
                len(results) == len(bodies) and all(s.tokens_seen() >= 3 for s in results.values())
            ),
            "tokens",
            180,
        )
        where = {rid: spy.worker_of(rid) for rid in bodies}
        victim = max(set(where.values()), key=list(where.values()).count)
        before = migrations(cluster.gateway)
        cluster.podman("pod", "kill", victim)  # SIGKILL to every container of the pod
        await asyncio.wait_for(task, 300)
    finally:
        await spy.close()
    assert_same(results, reference)
    moved = {rid for rid in bodies if len(spy.sent[rid]) > 1}
    assert moved and all(spy.sent[rid][0] == victim for rid in moved), dict(spy.sent)
    assert migrations(cluster.gateway) - before == len(moved)
    cluster.pods.pop(victim)  # gone for the next test


async def test_stopping_a_prefill_pod_during_pulls_loses_nothing(cluster: Cluster) -> None:
    from tests.integration.migration_stack import until

    bodies = {f"sp-{i}": completion(100 + i, 24) for i in range(10)}
    reference: dict = {}
    await run_all(cluster.gateway, {f"ref-{r}": b for r, b in bodies.items()}, reference)
    decode = cluster.role_pods("decode")
    counters = ("pdserve_kv_pull_failures_total", "pdserve_kv_recomputes_total")
    before = {(d, c): metric_sum(cluster.url(d), c) for d in decode for c in counters}

    results: dict = {}
    task = asyncio.create_task(run_all(cluster.gateway, bodies, results))
    leases = {}

    def leased() -> bool:
        leases.update({p: cluster.ready(p)[1].get("leases", 0) for p in prefill})
        return any(leases.values())

    prefill = cluster.role_pods("prefill")
    await until(leased, "KV leased on a prefill pod", 180)
    victim = max(leases, key=leases.get)
    # As the kubelet ends a pod: SIGTERM to the worker's container, SIGKILL after the grace
    # period, and the sandbox (podman's infra container, which holds the pod's network) last.
    # `podman pod stop` alone will not do: podman 4.3 stops the infra container beside the
    # others, so the draining worker lost its network mid-drain and its leases went unpulled.
    grace = "45"

    def stop_pod() -> None:
        cluster.podman("stop", "-t", grace, f"{victim}-prefill", timeout=120)
        cluster.podman("pod", "stop", victim, timeout=60)

    stopper = threading.Thread(target=stop_pod)
    stopper.start()
    status, at_drain = 0, {}
    for _ in range(100):  # the drain as the kubelet's readiness probe sees it
        status, at_drain = await asyncio.to_thread(cluster.ready, victim)
        if at_drain.get("status") == "draining" or status == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.wait_for(task, 300)
    await asyncio.to_thread(stopper.join, 120)
    print(f"{victim}: {leases[victim]} leases at SIGTERM; /ready then: {status} {at_drain}")
    logs = cluster.podman.logs(f"{victim}-prefill", 100_000)
    try:
        assert_same(results, reference)
    except AssertionError as failed:  # the drain as the stopped worker told it
        raise AssertionError(f"{failed}\n{victim}'s log:\n{logs[-4000:]}") from None
    for d in decode:  # every pull succeeded: nothing failed, nothing was prefilled again
        for c in counters:
            assert metric_sum(cluster.url(d), c) == before[(d, c)], (d, c)
    state = cluster.podman("pod", "inspect", victim, "--format", "{{.State}}")
    assert state == "Exited", state
    exit_code = cluster.podman("inspect", f"{victim}-prefill", "--format", "{{.State.ExitCode}}")
    assert exit_code == "0", logs[-3000:]  # it left by itself, before the grace period's SIGKILL
    # Prompts it had not finished within PDSERVE_DRAIN_SECONDS (30 s) are retried by the
    # gateways elsewhere (the texts above prove it); on a loaded 2-core machine that happens.
    print(f"{victim}: drain within budget: {'drain time over' not in logs}")
