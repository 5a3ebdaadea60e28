"""Stored responses in a real NATS JetStream (``gateway/responses/jetstream_store.py``), behind
real gateways over HTTP: a conversation stored through one gateway and continued through a
second, which reads, lists and deletes it too; a gateway started after the first is gone finds
what it stored; the bucket's TTL expires a response; a later gateway's settings update the
bucket; a NATS without JetStream is said in one line while plain requests are served and
explicit ones get the 400; and a 3-node cluster keeps the bucket in 3 replicas, so a stored
response outlives the node its gateway was connected to.

Behind the gateways runs a scripted decode worker on the real bus (each request answered with
the next of its replies), so the tests pin down the gateway and the store, not a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.gateway.responses.handlers import RESPONSE_STORE_KEY
from pdserve.gateway.server import create_app
from pdserve.gateway.tokenizer import ModelTokenizer
from pdserve.services.control.processes import NatsCluster, NatsServer
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
from pdserve.shared.discovery.announce import HeartbeatPublisher
from tests.integration.stack import start_nats
from tests.unit.gateway_fixtures import train_byte_level, write_model_dir

MODEL = "tiny-responses"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(vocab_size=300), max_position_embeddings=512)


@pytest.fixture(scope="module")
def jetstream(tmp_path_factory) -> Iterator[NatsServer]:
    workdir = tmp_path_factory.mktemp("nats-js")
    server = start_nats(workdir, jetstream_dir=workdir / "store")
    yield server
    server.stop()


class ReplyingWorker:
    """A decode worker on the real bus: each request is answered, whole, with the next reply."""

    def __init__(self, nats_url: str, namespace: str, tokenizer: ModelTokenizer) -> None:
        self.bus = Bus(BusConfig(nats_url=nats_url, namespace=namespace), "replying-d0")
        self.tokenizer = tokenizer
        self.replies: list[str] = []
        self.requests: list[DecodeRequest] = []
        self.heartbeat = HeartbeatPublisher(self.bus, self.load, 0.2)

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            worker_id="replying-d0",
            role="decode",
            model=MODEL,
            free_blocks=100,
            total_blocks=100,
            running=0,
            waiting=0,
        )

    async def start(self) -> ReplyingWorker:
        await self.bus.connect()
        subject = self.bus.subjects.decode("replying-d0")
        await self.bus.subscribe(subject, self.on_decode, (DecodeRequest,))
        await self.heartbeat.start()
        return self

    async def stop(self) -> None:
        await self.heartbeat.stop()
        await self.bus.close()

    async def on_decode(self, msg: DecodeRequest, headers: dict[str, str]) -> None:
        self.requests.append(msg)
        text = self.replies.pop(0) if self.replies else "OK."
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        item = TokenItem(bus_id=msg.bus_id, token_ids=ids, finish_reason="stop", position=0)
        await self.bus.publish(msg.reply_to, TokenBatch([item]))

    def prompt(self, i: int = -1) -> str:
        return self.tokenizer.decode(self.requests[i].prompt_token_ids, skip_special_tokens=False)


@contextlib.asynccontextmanager
async def gateway(model_dir: Path, url: str, namespace: str, healthy: bool = True, **options: Any):
    """A gateway on ``url`` serving over real HTTP (loopback); ``healthy``: once it has heard
    the worker."""
    app = create_app(
        GatewayConfig(**{"worker_timeout": 30.0, **options}),
        EngineConfig(model=str(model_dir)),
        BusConfig(nats_url=url, namespace=namespace),
    )
    async with TestClient(TestServer(app)) as client:
        for _ in range(100 if healthy else 0):  # until the worker's heartbeat has been heard
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.1)
        yield client


@contextlib.asynccontextmanager
async def worker_for(model_dir: Path, url: str, namespace: str):
    worker = await ReplyingWorker(url, namespace, ModelTokenizer.from_dir(model_dir)).start()
    try:
        yield worker
    finally:
        await worker.stop()


async def post(client: TestClient, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = await client.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status == status, await response.text()
    return await response.json()


async def test_a_conversation_continues_through_a_second_gateway(model_dir, jetstream):
    url, ns = jetstream.url, "conv"
    async with worker_for(model_dir, url, ns) as worker:
        worker.replies = ["Uno.", "Dos."]
        async with gateway(model_dir, url, ns) as a, gateway(model_dir, url, ns) as b:
            one = await post(a, {"input": "One?"})
            assert one["store"] is True
            two = await post(b, {"input": "Two?", "previous_response_id": one["id"]})
            assert "One?" in worker.prompt() and "Uno." in worker.prompt()
            assert await (await b.get(f"/v1/responses/{one['id']}")).json() == one
            listed = await b.get(f"/v1/responses/{two['id']}/input_items?order=asc")
            texts = [i["content"][0]["text"] for i in (await listed.json())["data"]]
            assert texts == ["One?", "Uno.", "Two?"]
            deleted = await b.delete(f"/v1/responses/{one['id']}")
            assert (await deleted.json())["deleted"] is True
            assert (await a.get(f"/v1/responses/{one['id']}")).status == 404
        # every gateway is gone; one started now finds what they stored
        async with gateway(model_dir, url, ns) as c:
            assert (await (await c.get(f"/v1/responses/{two['id']}")).json()) == two
            await post(c, {"input": "Three?", "previous_response_id": two["id"]})
            assert "Dos." in worker.prompt() and "Two?" in worker.prompt()


async def test_a_stored_response_expires_with_the_buckets_ttl(model_dir, jetstream):
    url, ns = jetstream.url, "ttl"
    async with (
        worker_for(model_dir, url, ns),
        gateway(model_dir, url, ns, response_store_ttl=1.0) as client,
    ):
        out = await post(client, {"input": "Hi"})
        assert (await client.get(f"/v1/responses/{out['id']}")).status == 200
        for _ in range(60):  # JetStream expires messages about once a second past their age
            await asyncio.sleep(0.25)
            if (await client.get(f"/v1/responses/{out['id']}")).status == 404:
                break
        else:
            pytest.fail("the response outlived the bucket's TTL")


async def test_a_later_gateways_settings_update_the_bucket(model_dir, jetstream):
    url, ns = jetstream.url, "settings"
    async with gateway(model_dir, url, ns, False, response_store_ttl=100.0):
        pass
    async with gateway(model_dir, url, ns, False, response_store_ttl=200.0) as client:
        assert client.app[RESPONSE_STORE_KEY].ready
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().stream_info("KV_settings_responses")
        finally:
            await nc.close()
    assert info.config.max_age == 200.0 and info.config.num_replicas == 1


async def test_without_jetstream_one_line_plain_requests_served_explicit_ones_refused(
    model_dir, tmp_path, caplog
):
    plain = start_nats(tmp_path)  # core NATS only
    caplog.set_level(logging.WARNING)
    try:
        async with (
            worker_for(model_dir, plain.url, "plain"),
            gateway(model_dir, plain.url, "plain") as client,
        ):
            out = await post(client, {"input": "Hi"})
            assert out["status"] == "completed" and out["store"] is False
            error = (await post(client, {"input": "Hi", "store": True}, 400))["error"]
            assert error["code"] == "response_store_unavailable" and error["param"] == "store"
            assert "no JetStream" in error["message"]
            assert (await client.get(f"/v1/responses/{out['id']}")).status == 400
    finally:
        plain.stop()
    said = [r.getMessage() for r in caplog.records if "JetStream" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and plain.url in said[0], said


async def test_a_cluster_keeps_three_replicas_and_loses_nothing_with_a_node(model_dir, tmp_path):
    cluster = NatsCluster.local(3, tmp_path, jetstream_dir=tmp_path / "js")
    cluster.start()
    try:
        async with (
            worker_for(model_dir, cluster.url, "ha"),
            gateway(model_dir, cluster.client_url(0), "ha", response_store_replicas=3) as client,
        ):
            store = client.app[RESPONSE_STORE_KEY]
            for _ in range(150):  # JetStream elects its meta leader first; the store retries
                if store.ready:
                    break
                await asyncio.sleep(0.2)
            assert store.ready, store.problem
            out = await post(client, {"input": "Keep me"})
            nc = await nats.connect(servers=cluster.client_url(1).split(","))
            try:
                info = await nc.jetstream().stream_info("KV_ha_responses")
            finally:
                await nc.close()
            assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
            cluster.nodes[0].stop()  # the gateway's own node: it fails over to the others
            for _ in range(100):
                got = await client.get(f"/v1/responses/{out['id']}")
                if got.status == 200:
                    break
                await asyncio.sleep(0.2)
            assert got.status == 200 and (await got.json())["id"] == out["id"]
    finally:
        cluster.stop()
