"""The NATS ``pdserve up`` starts runs JetStream (stored responses): its config carries the store,
each cluster node has a store of its own, and the store under the cache directory belongs to
one stack at a time (nats-server does not lock it; two servers on one store would corrupt it),
a second stack getting a temporary one. No process is started: the config text and the locks
are what is checked; a real nats-server with JetStream runs in
tests/integration/test_responses_store.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.services.control.local_nats import StoreDir
from pdserve.services.control.processes import NatsCluster, NatsServer


def test_the_config_turns_jetstream_on_with_its_store(tmp_path: Path) -> None:
    plain = NatsServer(workdir=tmp_path).config_text()
    assert "jetstream" not in plain  # tests' own servers stay core NATS unless asked
    store = tmp_path / "a dir" / "store"
    text = NatsServer(workdir=tmp_path, jetstream_dir=store).config_text()
    assert f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}\n" in text
    cluster = NatsCluster.local(3, tmp_path, jetstream_dir=tmp_path / "js")
    dirs = [node.jetstream_dir for node in cluster.nodes]
    assert dirs == [tmp_path / "js" / f"node-{i}" for i in (1, 2, 3)]
    assert all('server_name: "node-' in node.config_text() for node in cluster.nodes)


def test_the_cache_store_belongs_to_one_stack_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first, second = StoreDir("jetstream"), StoreDir("jetstream")
    assert first.acquire() == tmp_path / "nats" / "jetstream" / "store"
    taken = second.acquire()  # another stack holds it: a temporary store, said so
    assert second.temporary and not taken.is_relative_to(tmp_path)
    assert "temporary" in second.describe() and "temporary" not in first.describe()
    first.release()
    third = StoreDir("jetstream")
    assert third.acquire() == first.path and not third.temporary
    third.release()
    cluster = StoreDir("cluster-3")
    assert cluster.acquire() == tmp_path / "nats" / "cluster-3" / "store"
    cluster.release()
