"""``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (gateway/lora_admin.py) and
their bus messages (shared/discovery/lora_admin.py): admin keys only, the worker's answer over
request/reply on its LoRA subject, a refusal's reason in a 400, a load listed at once in
``/v1/models``, an unloaded name a 404 at once (before the worker's next report drops it).
The worker here is scripted (tests/unit/fake_workers.py); tests/integration/test_lora_runtime.py
runs the same against real workers and engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.shared.bus.protocol import ProtocolError, decode, decode_as, encode
from pdserve.shared.bus.subjects import Subjects
from pdserve.shared.discovery.lora_admin import (
    LoadLoraAdapter,
    LoraAdapterAnswer,
    LoraCommand,
    UnloadLoraAdapter,
    answer_lora_commands,
    lora_subject,
)
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir

USER, ADMIN = "user-key", "admin-key"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(300), max_position_embeddings=1024)


def test_messages_round_trip_and_are_checked() -> None:
    load = LoadLoraAdapter(request_id="l1", name="sql", path="/adapters/sql")
    assert decode(encode(load)) == load
    unload = UnloadLoraAdapter(request_id="l2", name="sql")
    assert decode_as(encode(unload), LoadLoraAdapter, UnloadLoraAdapter) == unload
    answer = LoraAdapterAnswer(request_id="l2", worker_id="d0", status="deferred")
    assert decode(encode(answer)) == answer
    with pytest.raises(ProtocolError):  # a status outside the list
        decode(encode(LoraAdapterAnswer(request_id="x", worker_id="d0", status="maybe")))
    with pytest.raises(ProtocolError):  # the worker id must be one subject token
        decode(encode(LoraAdapterAnswer(request_id="x", worker_id="a.b", status="ok")))
    assert lora_subject(Subjects("pdserve"), "d0") == "pdserve.admin.d0.lora"


class ScriptedAdapters:
    """What a worker's engine answers, kept as a set of names."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.seen: list[LoraCommand] = []

    async def __call__(self, cmd: LoraCommand) -> tuple[str, str]:
        self.seen.append(cmd)
        if isinstance(cmd, UnloadLoraAdapter):
            if cmd.name not in self.names:
                return "unknown", "no such adapter"
            self.names.discard(cmd.name)
            return "deferred", ""
        if cmd.path == "/bad":
            return "invalid", f"cannot read {cmd.path}/adapter_config.json"
        if cmd.name in self.names:
            return "exists", "already loaded"
        self.names.add(cmd.name)
        return "ok", ""


async def models(client) -> list[str]:
    resp = await client.get("/v1/models", headers={"x-api-key": ADMIN})
    return [c["id"] for c in (await resp.json())["data"]]


async def test_load_and_unload_through_the_gateway(model_dir) -> None:
    adapters = ScriptedAdapters()
    admin = {"x-api-key": ADMIN}
    async with serving(model_dir, api_key=[USER], admin_api_key=[ADMIN]) as (client, d0):
        await answer_lora_commands(d0.bus, d0.worker_id, adapters)
        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        user = {"Authorization": f"Bearer {USER}"}
        assert (await client.post(LOAD, json=body, headers=user)).status == 403
        assert (await client.post(UNLOAD, json=body, headers=user)).status == 403
        assert adapters.seen == []

        done = await client.post(LOAD, json=body, headers=admin)
        assert done.status == 200, await done.text()
        assert (await done.json())["workers"] == {"d0": {"status": "ok", "error": ""}}
        assert "sql" in await models(client)  # before the worker's next report
        again = await client.post(LOAD, json=body, headers=admin)
        assert again.status == 400 and "already" in (await again.json())["error"]["message"]

        bad = await client.post(LOAD, json={"lora_name": "x", "lora_path": "/bad"}, headers=admin)
        assert bad.status == 400
        error = (await bad.json())["error"]
        assert "cannot read /bad" in error["message"] and error["param"] == "lora_path"
        missing = await client.post(LOAD, json={"lora_name": "x"}, headers=admin)
        assert missing.status == 400 and (await missing.json())["error"]["param"] == "lora_path"

        await d0.beat(lora_adapters=["sql"])  # its report, from before the unload
        gone = await client.post(UNLOAD, json={"lora_name": "sql"}, headers=admin)
        assert gone.status == 200, await gone.text()
        assert (await gone.json())["workers"]["d0"]["status"] == "deferred"
        assert "sql" not in await models(client)  # at once, though the report still lists it
        ask = {"model": "sql", "prompt": "hi", "max_tokens": 1}
        assert (await client.post("/v1/completions", json=ask, headers=admin)).status == 404
        nope = await client.post(UNLOAD, json={"lora_name": "nope"}, headers=admin)
        assert nope.status == 404

        await d0.beat(lora_adapters=[])  # its next report drops it: loadable again
        assert (await client.post(LOAD, json=body, headers=admin)).status == 200
        assert "sql" in await models(client)


async def test_a_load_is_all_or_nothing(model_dir) -> None:
    """A worker that does not answer: 503, and the one that loaded unloads it again."""
    from tests.unit.fake_workers import FakeWorker, settle

    adapters = ScriptedAdapters()
    admin = {"x-api-key": ADMIN}
    async with serving(model_dir, admin_api_key=[ADMIN]) as (client, d0):
        await answer_lora_commands(d0.bus, d0.worker_id, adapters)
        silent = await FakeWorker(d0.bus.nc.network, "prefill", "p0").start()  # never answers
        await settle()
        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        resp = await client.post(LOAD, json=body, headers=admin)
        assert resp.status == 503, await resp.text()
        assert "p0" in (await resp.json())["error"]["message"]
        assert [type(c).__name__ for c in adapters.seen] == ["LoadLoraAdapter", "UnloadLoraAdapter"]
        assert adapters.names == set() and "sql" not in await models(client)
        await silent.bus.close()
