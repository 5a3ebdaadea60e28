"""The NATS layer against a real nats-server: delivery with headers, input filtering, auth,
TLS, and surviving a server restart."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.lease_messages import ReleaseLease
from pdserve.shared.bus.protocol import encode
from pdserve.shared.bus.request_messages import Cancel
from pdserve.shared.config import BusConfig
from pdserve.shared.discovery.worker_registry import WorkerRegistry
from tests.integration.stack import NatsServer, free_port, start_nats


@pytest.fixture(scope="module")
def nats(tmp_path_factory) -> NatsServer:
    server = start_nats(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


async def settle(bus: Bus) -> None:
    """Make new subscriptions live before anyone publishes to them.

    A flush only proves the server read our SUB: nats-server 2.15 can still drop a message sent
    a few milliseconds later (measured: 2 of 150 first messages lost with a flush alone, 0 of 150
    with 50 ms more). Real subscribers live long before traffic; tests publish at once.
    """
    await bus.flush()
    await asyncio.sleep(0.05)


def bus_for(url: str, **kw) -> Bus:
    return Bus(BusConfig(nats_url=url, namespace="t", **kw), "test")


async def collect(bus: Bus, subject: str, accept: tuple[type, ...]) -> asyncio.Queue:
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg, headers) -> None:
        await got.put((msg, headers))

    await bus.subscribe(subject, handler, accept)
    await settle(bus)
    return got


async def test_publish_subscribe_with_headers(nats) -> None:
    a, b = bus_for(nats.url), bus_for(nats.url)
    await a.connect()
    await b.connect()
    try:
        subject = b.subjects.cancel
        got = await collect(b, subject, (Cancel,))
        tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        await a.publish(subject, Cancel("r1"), headers={"traceparent": tp})
        msg, headers = await asyncio.wait_for(got.get(), 5)
        assert msg == Cancel("r1")
        assert headers["traceparent"] == tp
    finally:
        await a.close()
        await b.close()


async def test_bad_input_is_dropped_and_counted(nats) -> None:
    """Junk, wrong types and oversized messages never reach the handler; good ones still do."""
    sender = bus_for(nats.url)
    receiver = bus_for(nats.url, max_message_bytes=1024)
    await sender.connect()
    await receiver.connect()
    try:
        subject = receiver.subjects.lease("p0")
        got = await collect(receiver, subject, (ReleaseLease,))
        nc = sender.nc
        await nc.publish(subject, b"\xc1garbage")
        await nc.publish(subject, encode(Cancel("r1")))  # valid message, wrong subject type
        await nc.publish(subject, b"\x00" * 4096)  # over this receiver's limit
        load = WorkerLoad("x", "decode", "m" * 200, 1, 1, 0, 0)
        assert len(encode(load)) < 1024
        await nc.publish(subject, encode(ReleaseLease("ok")))
        await sender.flush()  # all four are on the server before the wait starts
        msg, _ = await asyncio.wait_for(got.get(), 15)
        assert msg == ReleaseLease("ok")
        assert got.empty()
        assert receiver.stats.rejected == 3
        # and the sender refuses to publish beyond its own limit
        small = bus_for(nats.url, max_message_bytes=16)
        await small.connect()
        with pytest.raises(ValueError, match="exceeds"):
            await small.publish(subject, load)
        await small.close()
    finally:
        await sender.close()
        await receiver.close()


async def test_token_auth(tmp_path) -> None:
    server = start_nats(tmp_path, token="s3cret")
    try:
        good = bus_for(server.url, nats_token="s3cret")
        await good.connect(timeout=5)
        assert good.connected
        await good.close()
        bad = bus_for(server.url, nats_token="wrong")
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="rejected our credentials"):
            await bad.connect(timeout=30)
        assert time.monotonic() - t0 < 5  # fails at once, not after the connect timeout
    finally:
        server.stop()


async def test_user_password_auth(tmp_path) -> None:
    server = start_nats(tmp_path, user="pd", password="pw")
    try:
        good = bus_for(server.url, nats_user="pd", nats_password="pw")
        await good.connect(timeout=5)
        assert good.connected
        await good.close()
        with pytest.raises(ConnectionError, match="rejected our credentials"):
            await bus_for(server.url, nats_user="pd", nats_password="nope").connect(timeout=30)
    finally:
        server.stop()


async def test_nobody_listening_times_out(tmp_path) -> None:
    with pytest.raises(ConnectionError, match="no NATS server answered"):
        await bus_for(f"nats://127.0.0.1:{free_port()}").connect(timeout=1.0)


def make_cert(tmp: Path) -> tuple[Path, Path]:
    key, cert = tmp / "server.key", tmp / "server.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
    )
    return key, cert


async def test_tls(tmp_path) -> None:
    """A CA file in BusConfig turns TLS on and verifies the server against it."""
    key, cert = make_cert(tmp_path)
    server = NatsServer(
        workdir=tmp_path, log_path=tmp_path / "nats.log", tls_cert=cert, tls_key=key
    )
    server.start()
    try:
        good = bus_for(f"tls://127.0.0.1:{server.port}", nats_tls_ca=str(cert))
        await good.connect(timeout=5)
        got = await collect(good, good.subjects.cancel, (Cancel,))
        await good.publish(good.subjects.cancel, Cancel("over-tls"))
        assert (await asyncio.wait_for(got.get(), 5))[0] == Cancel("over-tls")
        await good.close()
        # without the CA the self-signed server is not trusted
        with pytest.raises(ConnectionError):
            await bus_for(f"tls://127.0.0.1:{server.port}").connect(timeout=1.5)
    finally:
        server.stop()


async def test_survives_server_restart(tmp_path) -> None:
    server = start_nats(tmp_path)
    a, b = bus_for(server.url), bus_for(server.url)
    try:
        await a.connect()
        await b.connect()
        got = await collect(b, b.subjects.cancel, (Cancel,))
        server.restart(down_seconds=0.3)
        # reconnect is automatic, and subscriptions come back with it
        for _ in range(100):
            if a.stats.reconnects and b.stats.reconnects:
                break
            await asyncio.sleep(0.1)
        assert a.stats.reconnects >= 1 and b.stats.reconnects >= 1
        assert a.connected and b.connected
        await settle(b)
        await a.publish(a.subjects.cancel, Cancel("after-restart"))
        msg, _ = await asyncio.wait_for(got.get(), 5)
        assert msg == Cancel("after-restart")
    finally:
        await a.close()
        await b.close()
        server.stop()


# -- discovery over the same server -------------------------------------------------------------


async def until(pred: Callable[[], object], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


@contextlib.asynccontextmanager
async def watched_registry(
    url: str, timeout: float
) -> AsyncIterator[tuple[Bus, WorkerRegistry, list[tuple[str, str]]]]:
    """A worker-side bus, and a gateway-side registry that logs (event, worker id) as it goes."""
    worker_bus, gw_bus = bus_for(url), bus_for(url)
    await worker_bus.connect()
    await gw_bus.connect()
    registry = WorkerRegistry(gw_bus, timeout=timeout)
    events: list[tuple[str, str]] = []
    registry.add_listener(lambda event, load: events.append((event, load.worker_id)))
    try:
        await registry.start()
        await settle(gw_bus)
        yield worker_bus, registry, events
    finally:
        await registry.stop()
        await worker_bus.close()
        await gw_bus.close()


async def test_heartbeats_registry_and_ageing_out(nats) -> None:
    from pdserve.shared.discovery.announce import HeartbeatPublisher
    from pdserve.shared.discovery.worker_registry import JOINED, LEFT

    async with watched_registry(nats.url, timeout=0.6) as (worker_bus, registry, events):
        state = {"draining": False}

        def load_of(worker_id: str, role: str):
            return lambda: WorkerLoad(worker_id, role, "m", 7, 8, 1, 0, state["draining"])

        clean = HeartbeatPublisher(worker_bus, load_of("d0", "decode"), interval=0.1)
        crashy = HeartbeatPublisher(worker_bus, load_of("p0", "prefill"), interval=0.1)
        await clean.start()
        await crashy.start()

        await until(lambda: len(registry.loads()) == 2)
        assert [w.worker_id for w in registry.routable("decode")] == ["d0"]
        assert registry.get("p0").free_blocks == 7
        assert sorted(events) == [(JOINED, "d0"), (JOINED, "p0")]

        state["draining"] = True  # a draining worker stays known but takes nothing new
        await until(lambda: registry.get("d0").draining)
        assert registry.routable("decode") == [] and registry.get("d0") is not None

        # killed and restarted under the same id before the timeout: a new incarnation, so
        # the registry reports the old one gone (its requests are lost) and the new one joined
        await clean.stop(gone=False)
        events.clear()
        restarted = HeartbeatPublisher(
            worker_bus, lambda: replace(load_of("d0", "decode")(), instance="second"), 0.1
        )
        await restarted.start()
        await until(lambda: registry.get("d0").instance == "second")
        assert events == [(LEFT, "d0"), (JOINED, "d0")]

        await restarted.stop(gone=True)  # clean exit: gone at once
        await until(lambda: registry.get("d0") is None, timeout=0.3)
        await crashy.stop(gone=False)  # like kill -9: ages out after the timeout
        assert registry.get("p0") is not None
        await until(lambda: registry.get("p0") is None, timeout=3.0)
        # reported gone once a ping found nobody answering (no responders: at once)
        await until(lambda: (LEFT, "p0") in events, timeout=0.5)
        assert (LEFT, "d0") in events


async def test_silent_worker_that_answers_pings_is_not_reported_gone(nats) -> None:
    """A live worker whose heartbeats are late (a starved event loop) stops being routable
    while silent, but keeps its requests: the registry pings before it reports a departure."""
    from pdserve.shared.discovery.announce import HeartbeatPublisher
    from pdserve.shared.discovery.worker_registry import LEFT

    async with watched_registry(nats.url, timeout=0.3) as (worker_bus, registry, events):
        # one beat, then silence far beyond the timeout; the ping subscription stays
        quiet = HeartbeatPublisher(
            worker_bus, lambda: WorkerLoad("d9", "decode", "m", 7, 8, 1, 0), interval=100.0
        )
        await quiet.start()
        await until(lambda: registry.get("d9") is not None, timeout=2.0)
        await asyncio.sleep(1.5)  # five timeouts, each answered by a ping
        assert registry.get("d9") is not None or "d9" in registry.suspects
        assert (LEFT, "d9") not in events
        await quiet.stop(gone=False)  # now it dies for real (no ping answers)
        await until(lambda: (LEFT, "d9") in events, timeout=1.0)


async def test_a_registry_whose_own_server_falls_silent_reports_nobody_gone(tmp_path) -> None:
    """Our server stops answering while our connection still looks up - a link down that TCP
    has not noticed (a partition took a gateway's NATS node away): every worker falls silent at
    once and no ping is answered. That silence is ours: nobody is reported gone (the gateway
    once failed every stream that way), and the workers are routable again once it answers."""
    from pdserve.shared.discovery.announce import HeartbeatPublisher
    from pdserve.shared.discovery.worker_registry import LEFT

    server = start_nats(tmp_path)
    try:
        async with watched_registry(server.url, timeout=0.3) as (worker_bus, registry, events):
            beats = HeartbeatPublisher(
                worker_bus, lambda: WorkerLoad("d7", "decode", "m", 7, 8, 1, 0), interval=0.1
            )
            await beats.start()
            await until(lambda: registry.get("d7") is not None, timeout=2.0)
            assert server.child is not None
            server.child.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)  # silent for several rounds of ping and confirm
                assert (LEFT, "d7") not in events
            finally:
                server.child.signal(signal.SIGCONT)
            await until(lambda: registry.get("d7") is not None, timeout=3.0)
            assert (LEFT, "d7") not in events
            await beats.stop(gone=True)
    finally:
        server.stop()


async def test_micro_service_registration(nats) -> None:
    import json

    from pdserve.shared.discovery.announce import register_micro_service

    bus = bus_for(nats.url)
    await bus.connect()
    try:
        svc = await register_micro_service(bus, lambda: WorkerLoad("d7", "decode", "m", 3, 8, 0, 0))
        reply = await bus.nc.request("$SRV.INFO.pdserve-decode", b"", timeout=2)
        info = json.loads(reply.data)
        assert info["metadata"]["worker_id"] == "d7"
        reply = await bus.nc.request("t.status.d7", b"", timeout=2)
        assert json.loads(reply.data)["free_blocks"] == 3
        await svc.stop()
    finally:
        await bus.close()
