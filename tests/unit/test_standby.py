"""Standby workers without a model: the registry never routes to one (as to a draining one),
the heartbeat says standby and version, a promotion flips it and announces at once, and the
version a worker derives from its --model tells two checkpoint directories apart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from pdserve.gateway.router import Router
from pdserve.services import standby
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.protocol import decode_as, encode
from pdserve.shared.config import EngineConfig
from pdserve.shared.discovery.worker_registry import WorkerRegistry


def load(worker_id: str, role: str = "decode", **kw) -> WorkerLoad:
    return WorkerLoad(worker_id, role, "m", 10, 10, 0, 0, instance="i-" + worker_id, **kw)


async def test_the_registry_routes_to_no_standby_worker_until_it_says_it_serves() -> None:
    registry = WorkerRegistry(bus=None, timeout=60.0)  # type: ignore[arg-type]
    await registry._on_message(load("d0", model_version="v1"), {})
    await registry._on_message(load("d1", standby=True, model_version="v2"), {})
    router = Router(registry.routable, 16, model="m")
    assert [w.worker_id for w in registry.loads("decode")] == ["d0", "d1"]  # both known
    assert [w.worker_id for w in router.serving("decode")] == ["d0"]
    await registry._on_message(load("d1", model_version="v2"), {})  # promoted
    assert [w.worker_id for w in router.serving("decode")] == ["d0", "d1"]


def test_standby_and_version_travel_in_the_heartbeat() -> None:
    msg = load("d1", standby=True, model_version="tiny@1234abcd")
    back = decode_as(encode(msg), WorkerLoad)
    assert back.standby and back.model_version == "tiny@1234abcd"
    assert not decode_as(encode(load("d0")), WorkerLoad).standby  # the default: serving


def test_the_version_comes_from_the_flag_else_from_the_checkpoint_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "tiny", tmp_path / "b" / "tiny"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    va = standby.model_version(EngineConfig(model=str(a)))
    vb = standby.model_version(EngineConfig(model=str(b)))
    assert va.startswith("tiny@") and vb.startswith("tiny@") and va != vb
    assert standby.model_version(EngineConfig(model="demo")) == "demo"
    assert standby.model_version(EngineConfig(model_version="v7")) == "v7"


async def test_a_promotion_serves_and_announces_at_once() -> None:
    published: list[bool] = []

    class Presence:
        async def publish_load(self) -> None:
            published.append(worker.standby)

    tasks: list[asyncio.Task] = []
    spawn = SimpleNamespace(spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))
    worker = SimpleNamespace(standby=True, presence=Presence(), tasks=spawn)
    standby.promote(worker)
    await asyncio.gather(*tasks)
    assert worker.standby is False and published == [False]
    standby.promote(worker)  # a second signal changes nothing
    assert len(tasks) == 1
