"""What ``pdserve up`` checks before and while starting: a TP size the model cannot take, the
ports its services will bind, and how many workers the gateway has registered
(services/control/launcher.py)."""

from __future__ import annotations

import urllib.error
import urllib.request

from pdserve.shared.config import EngineConfig, GatewayConfig, UpConfig, WorkerConfig
from pdserve.shared.kv.tp_layout import tp_problem


def tp_refusal(
    up: UpConfig, engine: EngineConfig, num_heads: int, num_kv_heads: int, devices: int | None
) -> str | None:
    """Why a role's TP size cannot serve a model with these heads on ``devices`` GPUs (None: on
    the CPU), in one line naming the role, the flag that set the size and the numbers; or None.
    Only roles that run workers count (no prefill worker with --prefill-workers 0)."""
    for role, workers in (("prefill", up.prefill_workers), ("decode", up.decode_workers)):
        tp = up.role_tensor_parallel_size(role, engine.tensor_parallel_size)
        if workers < 1 or (problem := tp_problem(num_heads, num_kv_heads, tp, devices)) is None:
            continue
        own = getattr(up, f"{role}_tensor_parallel_size")
        flag = f"--{role}-tensor-parallel-size" if own else "--tensor-parallel-size"
        return (
            f"{role} workers: {problem.replace('--tensor-parallel-size', flag)} (the model has "
            f"{num_heads} attention heads and {num_kv_heads} KV heads)"
        )
    return None


def metrics_key(gateway: GatewayConfig) -> str | None:
    """The key ``pdserve up``'s own reads of the gateway's /metrics present (readiness,
    autoscaling, rollouts): a --metrics-api-key; None while /metrics is open."""
    return gateway.metrics_api_key[0] if gateway.metrics_api_key else None


def user_key(gateway: GatewayConfig) -> str | None:
    """The key ``pdserve up``'s own reads of the gateway's API present (a rollout's
    /v1/models): an --api-key, or an admin key (which user routes take too); None while the
    API is open."""
    keys = gateway.api_key or gateway.admin_api_key
    return keys[0] if keys else None


def keyed_request(url: str, key: str | None) -> urllib.request.Request:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return urllib.request.Request(url, headers=headers)


def metrics_request(base_url: str, key: str | None) -> urllib.request.Request:
    return keyed_request(base_url + "/metrics", key)


def registered_names(base_url: str, key: str | None = None) -> set[str]:
    """The worker ids the gateway knows (standby ones too), from its re-export of their loads on
    /metrics (read with ``key``: ``metrics_key``)."""
    try:
        with urllib.request.urlopen(metrics_request(base_url, key), timeout=2.0) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return set()
    return {
        line.split('worker="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("pdserve_kv_cache_total_blocks{") and 'worker="' in line
    }


def registered_workers(base_url: str, key: str | None = None) -> int:
    """How many workers the gateway knows."""
    return len(registered_names(base_url, key))


def promised_ports(
    up: UpConfig, gateway: GatewayConfig, worker: WorkerConfig, workers: int, ranks: int
) -> frozenset[int]:
    """The fixed ports ``pdserve up``'s services will bind once started: the gateway's, the
    planner's metrics, each worker's metrics port and each rank's UCX port (the launcher offsets
    them by slot and by rank). The private NATS picks its free ports clear of these: a port a
    caller found free for the gateway is free until the gateway binds it, after NATS started."""
    ports = {gateway.port, up.planner_metrics_port}
    if worker.metrics_port:
        ports.update(range(worker.metrics_port, worker.metrics_port + workers))
    if worker.ucx_port:
        ports.update(range(worker.ucx_port, worker.ucx_port + ranks))
    return frozenset(p for p in ports if p)
