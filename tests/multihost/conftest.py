"""Fixtures of the multi-host tier: the namespace topology (always torn down, by a finalizer
registered before anything is built) and pdserve spread over it."""

from __future__ import annotations

import time

import pytest

from tests.integration.migration_stack import worker_blocks
from tests.integration.stack import stop_all
from tests.multihost import netns
from tests.multihost.hosts import MultiHostStack, cluster_on

WORKER_OPTIONS = {
    "dtype": "float64",  # greedy ties cannot flip between engine and oracle
    "num_kv_blocks": 128,
    "block_size": 16,
    "max_num_batched_tokens": 512,
    "heartbeat_seconds": 0.2,
    # a KV pull that fails fails its request (the default, said here): a decode worker that
    # quietly recomputed would hide a pull that never crossed the bridge
    "kv_failure_policy": "fail",
}
GATEWAY_OPTIONS = {"worker_timeout": 2.0, "prefill_timeout": 4.0}


@pytest.fixture(scope="module")
def topology(request):
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host tier skipped: {reason}")
    topo = netns.new_topology()

    def remove() -> None:
        problems = topo.teardown()
        assert not problems and not topo.leftovers(), (problems, topo.leftovers())

    request.addfinalizer(remove)  # before building: a half-built topology is removed too
    return netns.build(["a", "b", "c"], topo)


@pytest.fixture(scope="module")
def stack(topology, tmp_path_factory, llama_dir):
    logs = tmp_path_factory.mktemp("multihost-logs")
    cluster = cluster_on(topology, logs)
    s = MultiHostStack(topology, cluster, logs)
    try:
        cluster.start(timeout=30)
        model = {"model": str(llama_dir)}
        s.start_service("b", {**model, **WORKER_OPTIONS})
        s.start_service("c", {**model, **WORKER_OPTIONS})
        s.start_service("a", {**model, **GATEWAY_OPTIONS})
        deadline = time.monotonic() + 180
        while set(worker_blocks(s.base_url)) != {"p0", "d0"}:
            for host, child in s.children.items():
                assert child.alive(), f"{child.name} died:\n{s.log(host)}"
            assert time.monotonic() < deadline, "the multi-host stack did not come up"
            time.sleep(0.2)
        yield s
    finally:
        for host, child in s.children.items():
            if not child.alive():
                print(f"{child.name} exited:\n{s.log(host)}")
        stop_all(list(s.children.values()))
        cluster.stop()
