"""The control channel of a running ``pdserve up``: NATS request/reply on
``<namespace>.control.launcher``, JSON bodies (``{"op": "rollout", "model": ...}``).

NATS because the stack already has it (and its auth): ``pdserve rollout --nats-url URL`` reaches
the launcher wherever the bus reaches. The launcher's main thread is its supervision loop, which
sleeps between polls, so the subscription lives in a thread of its own with its own event loop;
a request waits in a queue until the loop's next poll takes it, and its answer is sent back from
that thread when the operation is over (a rollout takes as long as a model takes to load).

Several ``pdserve up`` on one NATS server should use distinct ``--namespace`` values: each
launcher answers on its own namespace's subject.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.shared.bus.connection import Bus
from pdserve.shared.config import BusConfig

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


def control_subject(namespace: str) -> str:
    return f"{namespace}.control.launcher"


@dataclass
class ControlRequest:
    body: dict[str, Any]
    reply: Callable[[dict[str, Any]], None]  # thread-safe; call once


class ControlListener:
    def __init__(self, bus_config: BusConfig) -> None:
        self.bus_config = bus_config
        self.requests: queue.Queue[ControlRequest] = queue.Queue()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._answers: set[asyncio.Task] = set()  # replies on their way: sent before closing
        self._thread = threading.Thread(target=self._run, name="pdserve-control", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        self._ready.wait(timeout)
        if self._error is not None:
            raise self._error

    def get(self) -> ControlRequest | None:
        try:
            return self.requests.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5.0)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(); a later failure ends control only
            self._error = exc
            self._ready.set()
            log.warning("control channel stopped: %s", exc)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        bus = Bus(self.bus_config, "pdserve-launcher")
        await bus.connect(timeout=10.0)
        try:
            await bus.nc.subscribe(control_subject(self.bus_config.namespace), cb=self._on)
            self._ready.set()
            await self._stop.wait()
        finally:
            await asyncio.gather(*self._answers, return_exceptions=True)
            await bus.close()

    async def _on(self, msg: Any) -> None:
        if not msg.reply:
            return  # nobody to answer: ignored
        loop = asyncio.get_running_loop()

        def send(data: bytes) -> None:
            task = loop.create_task(msg.respond(data))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)

        def reply(answer: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(send, json.dumps(answer).encode())

        try:
            if len(msg.data) > MAX_BODY_BYTES:
                raise ValueError(f"body over {MAX_BODY_BYTES} bytes")
            body = json.loads(msg.data)
            if not isinstance(body, dict) or not isinstance(body.get("op"), str):
                raise ValueError('a JSON object with "op" is expected')
        except ValueError as exc:
            reply({"ok": False, "error": f"bad control request: {exc}"})
            return
        self.requests.put(ControlRequest(body, reply))


async def request(bus_config: BusConfig, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send ``body`` to the launcher and wait for its answer (the ``pdserve rollout`` side)."""
    bus = Bus(bus_config, "pdserve-control-client")
    await bus.connect(timeout=10.0)
    try:
        subject = control_subject(bus_config.namespace)
        reply = await bus.nc.request(subject, json.dumps(body).encode(), timeout=timeout)
        answer = json.loads(reply.data)
        return answer if isinstance(answer, dict) else {"ok": False, "error": "bad answer"}
    finally:
        await bus.close()
