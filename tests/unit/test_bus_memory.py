"""The in-memory bus behaves like the NATS one where pdserve relies on it."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.protocol import ProtocolError, encode
from pdserve.shared.bus.request_messages import Cancel
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.config import BusConfig
from tests.bus_memory import MemoryBus, MemoryNetwork, subject_matches


async def buses(n: int, **config) -> list[MemoryBus]:
    net = MemoryNetwork()
    out = []
    for i in range(n):
        bus = MemoryBus(BusConfig(namespace="t", **config), f"b{i}", network=net)
        await bus.connect()
        out.append(bus)
    return out


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_subject_matching() -> None:
    assert subject_matches("t.load.>", "t.load.decode.d0")
    assert not subject_matches("t.load.>", "t.load")
    assert subject_matches("t.*.d0", "t.decode.d0")
    assert not subject_matches("t.*", "t.decode.d0")
    assert subject_matches("t.cancel", "t.cancel") and not subject_matches("t.cancel", "t.cancelx")


async def test_messages_are_encoded_checked_and_decoded() -> None:
    a, b = await buses(2)
    got = []

    async def handler(msg, headers):
        got.append((msg, headers))

    await b.subscribe("t.x", handler, (Cancel,))
    await a.publish("t.x", Cancel("r1"), {"traceparent": "00-abc"})
    await a.publish("t.x", WorkerLoad("w", "decode", "m", 1, 1, 0, 0))  # a type it does not take
    await a.nc.publish("t.x", b"\x93junk")  # not msgpack of a message
    bad = msgpack.packb({"v": 2, "type": "cancel", "bus_id": "has space"})
    await a.nc.publish("t.x", bad)  # fails the schema check
    await settle()
    assert got == [(Cancel("r1"), {"traceparent": "00-abc"})]
    assert b.stats.received == 4 and b.stats.rejected == 3
    await a.close()
    await b.close()


async def test_size_limit_on_publish_and_receive() -> None:
    (small,) = await buses(1, max_message_bytes=200)
    big = TokenBatch([TokenItem("r", list(range(200)))])
    with pytest.raises(ProtocolError):
        await small.publish("t.x", big)
    got = []

    async def handler(msg, headers):
        got.append(msg)

    await small.subscribe("t.x", handler, (TokenBatch,))
    await small.nc.publish("t.x", encode(big))  # another process's bus has a larger limit
    await settle()
    assert got == [] and small.stats.rejected == 1
    await small.close()


async def test_queue_groups_and_ordering() -> None:
    a, b, c = await buses(3)
    seen: dict[str, list[str]] = {"b": [], "c": []}

    def handler(name):
        async def h(msg, headers):
            await asyncio.sleep(0)  # one at a time per subscription, in order
            seen[name].append(msg.bus_id)

        return h

    await b.subscribe("t.q", handler("b"), (Cancel,), queue="g")
    await c.subscribe("t.q", handler("c"), (Cancel,), queue="g")
    for i in range(6):
        await a.publish("t.q", Cancel(f"r{i}"))
    await settle()
    await asyncio.sleep(0.01)
    assert sorted(seen["b"] + seen["c"]) == [f"r{i}" for i in range(6)]
    assert len(seen["b"]) == len(seen["c"]) == 3
    assert seen["b"] == sorted(seen["b"])
    for bus in (a, b, c):
        await bus.close()


async def test_request_reply_no_responders_and_crash() -> None:
    a, b = await buses(2)

    async def on_ping(raw):
        await raw.respond(b"pong:" + raw.data)

    await b.nc.subscribe("t.ping.b", cb=on_ping)
    reply = await a.nc.request("t.ping.b", b"1", timeout=1)
    assert reply.data == b"pong:1"

    async def silent(raw):
        pass

    await b.nc.subscribe("t.slow", cb=silent)
    with pytest.raises(NatsTimeoutError):
        await a.nc.request("t.slow", b"", timeout=0.05)
    await b.nc.crash()  # kill -9: its subscriptions are gone, nobody answers
    with pytest.raises(NoRespondersError):
        await a.nc.request("t.ping.b", b"", timeout=1)
    assert not b.connected
    with pytest.raises(ConnectionError):
        await b.publish("t.x", Cancel("r"))
    await a.close()


async def test_reconnect_runs_callbacks() -> None:
    (a,) = await buses(1)
    calls = []

    async def again():
        calls.append(1)

    a.on_reconnect(again)
    await a.nc.reconnect()
    assert calls == [1] and a.stats.reconnects == 1
    await a.close()
    await a.close()  # twice is fine, as with NATS
