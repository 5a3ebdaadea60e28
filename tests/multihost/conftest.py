"""Fixtures of the multi-host tier: the namespace topology (always torn down, by a finalizer
registered before anything is built) and pdserve spread over it."""

from __future__ import annotations

import pytest

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
        s.start_1p1d(
            {**model, **WORKER_OPTIONS}, {**model, **WORKER_OPTIONS}, {**model, **GATEWAY_OPTIONS}
        )
        yield s
    finally:
        s.stop()
