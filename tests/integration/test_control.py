"""The launcher's control channel (services/control/channel.py) on a real nats-server: a request waits in
the queue until the supervision loop takes it, its answer reaches the caller from the loop's
thread; a body that is not a JSON object with "op" is answered with an error at once; and a
running rollout is answered when the launcher stops instead of leaving its caller waiting."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pdserve.services.control.channel import ControlListener, control_subject, request
from pdserve.services.control.rollout import RolloutDriver
from pdserve.shared.bus.connection import Bus
from pdserve.shared.config import BusConfig
from tests.integration.stack import start_nats


def take(listener: ControlListener, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (req := listener.get()) is None:
        assert time.monotonic() < deadline, "no request arrived"
        time.sleep(0.02)
    return req


async def test_a_request_is_queued_and_answered_from_the_supervision_thread(
    tmp_path: Path,
) -> None:
    nats = start_nats(tmp_path)
    config = BusConfig(nats_url=nats.url, namespace="ctl")
    listener = ControlListener(config)
    try:
        listener.start()
        assert listener.get() is None  # nothing waits: the loop's poll returns at once

        def supervise() -> None:  # the launcher's main thread, sleeping between polls
            req = take(listener)
            req.reply({"ok": True, "echo": req.body["model"]})

        thread = threading.Thread(target=supervise)
        thread.start()
        answer = await request(config, {"op": "rollout", "model": "m2"}, timeout=10)
        thread.join()
        assert answer == {"ok": True, "echo": "m2"}

        bus = Bus(config, "raw")
        await bus.connect()
        try:
            reply = await bus.nc.request(control_subject("ctl"), b"[1, 2]", timeout=5)
            assert b"bad control request" in reply.data
        finally:
            await bus.close()
        assert listener.get() is None  # a bad body never reaches the loop
    finally:
        listener.close()
        nats.stop()


async def test_a_rollout_in_progress_is_answered_when_the_launcher_stops(tmp_path: Path) -> None:
    nats = start_nats(tmp_path)
    config = BusConfig(nats_url=nats.url, namespace="ctl")
    fleet = SimpleNamespace(bus=config, common={"nats_url": nats.url})
    driver = RolloutDriver(fleet, "http://127.0.0.1:1")
    try:
        driver.start()
        pending = asyncio.ensure_future(request(config, {"op": "rollout", "model": "x"}, 10))

        def stop_soon() -> None:
            driver.current = (SimpleNamespace(), take(driver.listener))  # as if it ran
            driver.close()

        await asyncio.to_thread(stop_soon)
        assert (await pending) == {"ok": False, "error": "pdserve up is stopping"}
    finally:
        driver.close()
        nats.stop()
