"""compose/kubernetes/: every kustomization renders (``kubectl kustomize``), every object is valid
for a current Kubernetes in strict mode (``kubernetes-validate``: unknown fields are errors), the
InferencePool fits its CRD, and the manifests agree with pdserve itself: real subcommands,
``PDSERVE_*`` names pdserve reads, probes on the endpoints the processes serve, grace periods
that cover the drains, a GPU per TP rank, and a NetworkPolicy that lets through exactly the
traffic pdserve needs."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import urllib.request
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cli import COMMANDS
from pdserve.shared.options import env_name
from pdserve.shared.telemetry.health import Health

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "compose" / "kubernetes"
KUBECTL = shutil.which("kubectl")
# The newest Kubernetes whose schemas the pinned kubernetes-validate carries.
K8S_VERSION = kubernetes_validate.latest_version()
OVERLAYS = ["overlays/cpu", "overlays/gpu", "examples/replicas"]
GPU = ["overlays/gpu", "examples/replicas"]
ROLES = ("gateway", "prefill", "decode")
COMPONENT = "app.kubernetes.io/component"
# The InferencePool CRD, published by the Gateway API Inference Extension (Apache-2.0); read at
# test time, never copied here (INFERENCEPOOL_CRD_URL may name a copy, file:// included).
# Offline the structural checks below still run.
CRD_URL = os.environ.get("INFERENCEPOOL_CRD_URL") or (
    "https://raw.githubusercontent.com/kubernetes-sigs/gateway-api-inference-extension/"
    "v1.6.0/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
)

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: `kubectl kustomize` renders the manifests"
)


@cache
def render(target: str) -> tuple[dict, ...]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(KUBE / target)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of_kind(objects, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pods(objects) -> dict[str, dict]:
    """Workload name -> its pod template."""
    return {
        name: o["spec"]["template"]
        for kind in ("Deployment", "StatefulSet")
        for name, o in of_kind(objects, kind).items()
    }


def env_of(objects, container: dict) -> dict[str, str]:
    """The variables a container gets: its ConfigMaps (envFrom), then its own env (which wins)."""
    maps = of_kind(objects, "ConfigMap")
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        out.update(maps[source["configMapRef"]["name"]]["data"])
    out.update({e["name"]: e.get("value", "<from field>") for e in container.get("env", [])})
    return out


def subcommand(container: dict) -> str | None:
    command = container.get("command", [])
    return command[1] if command[:1] == ["pdserve"] else None


def direct_reads() -> set[str]:
    """PDSERVE_* variables product code reads itself (not through shared/config.py)."""
    names = set()
    for folder in ("gateway", "services", "shared", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            names |= set(re.findall(r"environ(?:\.get\(|\[)\s*\"(PDSERVE_[A-Z0-9_]+)\"", text))
    return names


def read_by(command: str) -> set[str]:
    fields = (f for cls in COMMANDS[command].options for f in dataclasses.fields(cls))
    return {env_name(f.name) for f in fields} | direct_reads()


@pytest.mark.parametrize("target", ["base", *OVERLAYS, "llm-d"])
def test_renders_and_every_object_is_valid_in_strict_mode(target: str) -> None:
    objects = render(target)
    assert objects
    for obj in objects:
        if obj["kind"] == "InferencePool":  # a CRD: checked against its own schema below
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{target}: {obj['kind']}/{obj['metadata']['name']}: {exc.message}")


def test_strict_validation_rejects_an_unknown_field() -> None:
    deployment = of_kind(render("overlays/cpu"), "Deployment")["prefill"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("target", OVERLAYS)
def test_containers_run_pdserve_subcommands_with_variables_pdserve_reads(target: str) -> None:
    objects = render(target)
    maps = of_kind(objects, "ConfigMap")
    map_users: dict[str, set[str]] = {}
    for name, pod in pods(objects).items():
        for c in pod["spec"]["containers"]:
            command = subcommand(c)
            if command is None:  # NATS, from the same image: no pdserve settings
                assert c["command"][0] == "nats-server", (name, c["command"])
                assert not [v for v in env_of(objects, c) if v.startswith("PDSERVE_")], name
                continue
            assert command in COMMANDS and COMMANDS[command].options, (name, command)
            for e in c.get("env", []):  # set for this container: its command must read it
                if e["name"].startswith("PDSERVE_"):
                    assert e["name"] in read_by(command), (name, command, e["name"])
            for source in c.get("envFrom", []):
                map_users.setdefault(source["configMapRef"]["name"], set()).add(command)
    for map_name, commands in map_users.items():  # shared: some command that loads it reads it
        readers = set().union(*(read_by(command) for command in commands))
        for variable in maps[map_name]["data"]:
            assert variable in readers, (map_name, variable)


@pytest.mark.parametrize("target", OVERLAYS)
def test_probes_ask_what_the_processes_serve(target: str) -> None:
    objects = render(target)
    worker_paths = set(Health().probes())
    gateway_source = (REPO / "gateway" / "server.py").read_text(encoding="utf-8")
    for name, pod in pods(objects).items():
        (c,) = pod["spec"]["containers"]
        env, ports = env_of(objects, c), {p["name"]: p["containerPort"] for p in c["ports"]}
        probes = {
            kind: c[f"{kind}Probe"]["httpGet"] for kind in ("startup", "readiness", "liveness")
        }
        paths = {kind: probe["path"] for kind, probe in probes.items()}
        if name in ("prefill", "decode"):
            assert paths == {"startup": "/ready", "readiness": "/ready", "liveness": "/live"}
            assert set(paths.values()) <= worker_paths
            assert {p["port"] for p in probes.values()} == {"metrics"}
            assert ports["metrics"] == int(env["PDSERVE_METRICS_PORT"])
            startup = c["startupProbe"]
            # a large checkpoint may take many minutes to load before the worker is ready
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
        elif name == "gateway":
            assert paths["readiness"] == "/health" and paths["liveness"] == "/metrics"
            for path in paths.values():  # routes the gateway adds (gateway/access.py:add_route)
                assert f'add_route(app, "GET", "{path}"' in gateway_source
            assert ports["http"] == int(env["PDSERVE_PORT"])
        else:
            assert set(paths.values()) == {"/healthz"}, name  # nats-server's monitoring port


def nats_conf(objects) -> str:
    (conf,) = [
        m["data"]["nats.conf"]
        for m in of_kind(objects, "ConfigMap").values()
        if "nats.conf" in m.get("data", {})
    ]
    return conf


def conf_seconds(conf: str, key: str) -> float:
    return float(re.search(rf'^{key}: "(\d+)s"', conf, re.M).group(1))


def pre_stop_seconds(container: dict) -> float:
    """How long a preStop hook holds the SIGTERM back (its trailing ``sleep N``)."""
    hook = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    found = re.search(r"sleep\W+(\d+)\W*$", " ".join(hook))
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("target", OVERLAYS)
def test_grace_periods_cover_each_drain(target: str) -> None:
    from pdserve.gateway.server import DRAIN_SECONDS  # the gateway's own, not a setting

    objects = render(target)
    for name, pod in pods(objects).items():
        (c,) = pod["spec"]["containers"]
        grace, env = pod["spec"]["terminationGracePeriodSeconds"], env_of(objects, c)
        hold = pre_stop_seconds(c)
        if name in ("prefill", "decode"):
            drain = float(env["PDSERVE_DRAIN_SECONDS"])
            assert hold == 0 and grace >= drain + 10, (name, grace, drain)
            if name == "prefill":  # a lease handed out just before SIGTERM can run its course
                assert drain >= float(env["PDSERVE_LEASE_SECONDS"])
        elif name == "gateway":  # endpoints leave the Service during the pause, then it drains
            assert 0 < hold and grace >= hold + DRAIN_SECONDS + 5, (grace, hold)
        else:  # NATS: lame duck, then its exit, before the kubelet's SIGTERM or SIGKILL
            conf = nats_conf(objects)
            duck = conf_seconds(conf, "lame_duck_duration")
            duck += conf_seconds(conf, "lame_duck_grace_period")
            assert "--signal ldm=" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
            assert duck < hold < grace, (duck, hold, grace)


@pytest.mark.parametrize("target", GPU)
def test_each_tp_rank_gets_a_gpu_and_shared_memory(target: str) -> None:
    objects = render(target)
    for name in ("prefill", "decode"):
        pod = pods(objects)[name]["spec"]
        (c,) = pod["containers"]
        tp = int(env_of(objects, c).get("PDSERVE_TENSOR_PARALLEL_SIZE", "1"))
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp, (name, tp)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == tp, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        (shm,) = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert pod.get("hostIPC") or volumes[shm]["emptyDir"]["medium"] == "Memory"
    gateway = pods(objects)["gateway"]["spec"]["containers"][0]
    assert gateway["image"].endswith("-cpu")  # the gateway never needs the GPU image


@pytest.mark.parametrize("target", OVERLAYS)
def test_resources_budgets_and_the_read_only_model(target: str) -> None:
    objects = render(target)
    budgets = of_kind(objects, "PodDisruptionBudget")
    for name, pod in pods(objects).items():
        labels = pod["metadata"]["labels"]
        for c in pod["spec"]["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)
        (budget,) = [
            b
            for b in budgets.values()
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert budget["spec"]["maxUnavailable"] == 1, name
        if labels[COMPONENT] not in ROLES:
            continue
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount["mountPath"] == "/model" and mount["readOnly"] is True, name
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
        if target == "overlays/cpu":
            assert set(volume) == {"name", "hostPath"}, volume
        else:
            assert volume["persistentVolumeClaim"]["readOnly"] is True
            if target.startswith("examples/"):
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert of_kind(objects, "PersistentVolumeClaim")[claim]["spec"]["accessModes"] == [
                    "ReadOnlyMany"
                ]


def test_clients_and_routes_name_the_nats_statefulsets_pods() -> None:
    objects = render("overlays/cpu")
    (nats,) = of_kind(objects, "StatefulSet").values()
    service = of_kind(objects, "Service")[nats["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    name, replicas = nats["metadata"]["name"], nats["spec"]["replicas"]
    nodes = [f"{name}-{i}.{service['metadata']['name']}" for i in range(replicas)]
    assert re.findall(r"nats://(\S+):6222", nats_conf(objects)) == nodes
    first = []
    for role in ROLES:  # every node, each once; each role starts on a node of its own
        url = env_of(objects, pods(objects)[role]["spec"]["containers"][0])["PDSERVE_NATS_URL"]
        hosts = [u.removeprefix("nats://") for u in url.split(",")]
        assert sorted(hosts) == [f"{n}:4222" for n in nodes], role
        first.append(hosts[0])
    assert len(set(first)) == len(ROLES)


def allowed(policies: list[dict], source: dict, dest: dict, port: int) -> bool:
    """NetworkPolicy ingress semantics for pods of one namespace: open unless some policy selects
    ``dest``; then some rule of those policies must match both the source and the port."""

    def selects(selector: dict, labels: dict) -> bool:
        if not selector.get("matchLabels", {}).items() <= labels.items():
            return False
        for expr in selector.get("matchExpressions", []):
            inside = labels.get(expr["key"]) in expr["values"]
            if inside != (expr["operator"] == "In"):
                return False
        return True

    def port_ok(rule_port: dict) -> bool:
        wanted = rule_port["port"]
        if isinstance(wanted, str):  # a named port of the destination's containers
            named = {p["name"]: p["containerPort"] for p in dest["ports"]}
            return named.get(wanted) == port
        return wanted <= port <= rule_port.get("endPort", wanted)

    mine = [p for p in policies if selects(p["spec"]["podSelector"], dest["labels"])]
    if not mine:
        return True
    return any(
        (
            not rule.get("from")
            or any(selects(peer["podSelector"], source["labels"]) for peer in rule["from"])
        )
        and (not rule.get("ports") or any(port_ok(p) for p in rule["ports"]))
        for policy in mine
        for rule in policy["spec"].get("ingress", [])
    )


def test_only_the_gateway_reaches_the_workers_and_workers_reach_each_other() -> None:
    objects = render("overlays/cpu")
    policies = list(of_kind(objects, "NetworkPolicy").values())
    pod = {
        name: {"labels": t["metadata"]["labels"], "ports": t["spec"]["containers"][0]["ports"]}
        for name, t in pods(objects).items()
    }
    stranger = {"labels": {"app": "something-else"}, "ports": []}
    go = lambda s, d, port: allowed(policies, s, pod[d], port)  # noqa: E731
    for worker in ("prefill", "decode"):
        assert go(pod["gateway"], worker, 9100)  # metrics, from the gateway
        for other in ("prefill", "decode"):  # KV pulls and UCX's way back, every TP rank's port
            assert go(pod[other], worker, 10100) and go(pod[other], worker, 10107)
            assert not go(pod[other], worker, 10108)
        assert not go(pod["nats"], worker, 9100) and not go(stranger, worker, 9100)
        assert not go(stranger, worker, 10100) and not go(pod["gateway"], worker, 10100)
        assert go(pod[worker], "nats", 4222) and not go(pod[worker], "nats", 6222)
    assert go(pod["gateway"], "nats", 4222) and go(pod["nats"], "nats", 6222)
    assert not go(stranger, "nats", 4222)
    assert go(stranger, "gateway", 8000) and not go(stranger, "gateway", 9100)


def test_the_inference_pool_points_at_the_gateways() -> None:
    """The structure the v1 CRD requires (selector, targetPorts, endpointPickerRef - required
    until v1.3), and that the pool's endpoints are the gateway pods on their API port."""
    (pool,) = render("llm-d")
    assert (
        pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    )
    spec = pool["spec"]
    assert {"selector", "targetPorts", "endpointPickerRef"} <= set(spec)
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(numbers) <= 8 and len(set(numbers)) == len(numbers)
    picker = spec["endpointPickerRef"]
    assert picker["name"] and 1 <= picker["port"]["number"] <= 65535  # port: needed for a Service
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    objects = render("overlays/cpu")
    selected = [
        name
        for name, t in pods(objects).items()
        if spec["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()
    ]
    assert selected == ["gateway"]
    gateway = pods(objects)["gateway"]["spec"]["containers"][0]
    assert numbers == [p["containerPort"] for p in gateway["ports"]]


def strict_schema(schema: dict) -> dict:
    """Kubernetes rejects unknown fields of a structural schema; JSON Schema allows them."""
    if isinstance(schema, dict):
        schema = {k: strict_schema(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict_schema(v) for v in schema]
    return schema


def test_the_inference_pool_against_its_published_crd() -> None:
    try:
        with urllib.request.urlopen(CRD_URL, timeout=5) as r:
            crd = yaml.safe_load(r.read())
    except OSError as exc:
        pytest.skip(f"the InferencePool CRD is not reachable ({exc}); structure checked above")
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    (pool,) = render("llm-d")
    jsonschema.validate(pool, schema)
