"""Tensor parallelism in compose's "gpu" profile, checked offline: a worker of TP N (PREFILL_TP,
DECODE_TP) reserves N GPUs through its one GPU variable, and no GPU serves two ranks, both as
shipped and in the layout .env.example shows in comments (one TP-2 prefill worker and two TP-1
decode workers on a 4-GPU host, prefill-1 left out)."""

from __future__ import annotations

import pytest

from tests.integration.test_compose import (
    ENV_EXAMPLE,
    active_services,
    environment_of,
    interpolate,
    load_raw,
    parse_with_env,
    pdserve_command,
    pdserve_services,
    read_dotenv,
    role_of,
)

TP_LAYOUT = {"PREFILL_TP": "2", "PREFILL_0_GPU": "0,1", "PREFILL_1_REPLICAS": "0", "DECODE_TP": "1"}
LAYOUTS = {
    "as-shipped": ({}, {"prefill": 2, "decode": 2}),
    "tp": (TP_LAYOUT, {"prefill": 1, "decode": 2}),
}


def test_the_tp_layout_is_the_one_env_example_shows() -> None:
    lines = ENV_EXAMPLE.read_text().splitlines()
    for name, value in TP_LAYOUT.items():
        assert f"# {name}={value}" in lines, f".env.example lacks the line '# {name}={value}'"


def gpu_workers(overrides: dict[str, str]) -> dict[str, dict]:
    """The GPU workers that run containers with .env.example plus ``overrides`` in .env."""
    doc = interpolate(load_raw(), {**read_dotenv(ENV_EXAMPLE).values, **overrides})
    services = pdserve_services({"services": active_services(doc, "gpu")})
    return {
        name: service
        for name, service in services.items()
        if role_of(name, service) != "gateway" and int(service["deploy"].get("replicas", 1)) > 0
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_owns_a_gpu(layout: str) -> None:
    overrides, expected_roles = LAYOUTS[layout]
    owners: dict[str, str] = {}
    roles = {"prefill": 0, "decode": 0}
    for name, service in gpu_workers(overrides).items():
        roles[role_of(name, service)] += 1
        env = environment_of(service)
        # the size reaches the worker as an option it reads, with the value compose gives it
        pdserve_env = {k: v for k, v in env.items() if k.startswith("PDSERVE_")}
        values = parse_with_env(pdserve_command(service), pdserve_env)
        tp = values["tensor_parallel_size"]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        (gpu_variable,) = device["device_ids"]
        gpus = [g.strip() for g in gpu_variable.split(",")]
        assert len(gpus) == tp, f"{name}: TP {tp} needs {tp} GPUs, given {gpus}"
        for gpu in gpus:
            assert gpu not in owners, f"GPU {gpu} given to {owners.get(gpu)} and {name}"
            owners[gpu] = name
    assert roles == expected_roles, layout
    assert sorted(owners) == ["0", "1", "2", "3"], f"{layout} fills the 4-GPU host"
