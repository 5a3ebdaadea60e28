"""/ready and /live of real worker processes (the probes compose/kubernetes/ points at).

A prefill worker started before its NATS server exists is alive but not ready (its model is
loaded, the bus is not there to join); once NATS is up and it has announced itself it is ready;
after SIGTERM, while a KV lease keeps it draining, it is alive and not ready, and /ready says
what it still waits for. The phases themselves and a stalled loop: tests/unit/test_health.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

from tests.integration.stack import free_port, log_text, start_nats, start_service, stop_all
from tests.integration.worker_client import connected

LEASE_SECONDS = 4.0
OPTIONS = {
    "num_kv_blocks": 64,
    "block_size": 16,
    "heartbeat_seconds": 0.2,
    "lease_seconds": LEASE_SECONDS,
    "drain_seconds": 60.0,
}


def probe(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}  # not listening (yet, or any more)


async def until_probe(port: int, path: str, want, child, timeout: float = 120.0):
    """Poll ``path`` until ``want(status, body)``; fail at once if ``child`` dies."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        status, body = await asyncio.to_thread(probe, port, path)
        if want(status, body):
            return status, body
        assert child.alive(), f"{child.name} died:\n{log_text(child)}"
        assert loop.time() < deadline, f"{path}: last answer {status} {body}"
        await asyncio.sleep(0.05)


async def test_ready_and_live_follow_a_workers_life(tmp_path) -> None:
    nats_port = free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    p_port, d_port = free_port(), free_port()
    prefill = start_service(
        "prefill",
        nats_url,
        tmp_path,
        options={**OPTIONS, "worker_id": "p0", "metrics_port": p_port},
    )
    children, nats = [prefill], None
    try:
        # No NATS yet: the metrics port answers, the model loads, and it stays unready.
        status, body = await until_probe(
            p_port, "/ready", lambda s, b: b.get("status") == "joining", prefill
        )
        assert status == 503 and "NATS" in body["reason"]
        assert await asyncio.to_thread(probe, p_port, "/live") == (
            200,
            {"status": "alive", "phase": "joining"},
        )
        await asyncio.sleep(1.0)
        assert (await asyncio.to_thread(probe, p_port, "/ready"))[0] == 503

        nats = start_nats(tmp_path, port=nats_port)
        decode = start_service(
            "decode",
            nats_url,
            tmp_path,
            options={**OPTIONS, "worker_id": "d0", "metrics_port": d_port},
        )
        children.append(decode)
        async with connected(nats_url, children) as gw:
            ready = lambda s, b: s == 200  # noqa: E731
            assert await until_probe(p_port, "/ready", ready, prefill) == (
                200,
                {"status": "ready", "requests": 0, "leases": 0},
            )
            assert await until_probe(d_port, "/ready", ready, decode) == (
                200,
                {"status": "ready", "requests": 0},
            )

            # A prompt's KV under lease, then SIGTERM: draining until the lease expires.
            result = await gw.prefill("p0", "held", list(range(5, 45)))
            assert result.kv is not None
            prefill.signal(signal.SIGTERM)
            status, body = await until_probe(
                p_port, "/ready", lambda s, b: b.get("status") == "draining", prefill
            )
            assert status == 503 and body["leases"] == 1 and body["requests"] == 0
            assert "no new requests" in body["reason"]
            assert await asyncio.to_thread(probe, p_port, "/live") == (
                200,
                {"status": "alive", "phase": "draining"},
            )
            # the lease ran out (nobody pulled it): the drain is over and the worker exits
            code = await asyncio.to_thread(prefill.wait, LEASE_SECONDS + 15)
            assert code == 0, log_text(prefill)
            assert await asyncio.to_thread(probe, p_port, "/ready") == (0, {})
            assert decode.alive()
    finally:
        stop_all(children)
        if nats is not None:
            nats.stop()
