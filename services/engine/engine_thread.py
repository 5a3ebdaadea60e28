"""The thread that owns a worker's engine: it steps whenever there is work and hands each step's
result to the asyncio loop with ``call_soon_threadsafe``.

The step is blocking CPU/GPU work, so the loop stays free for NATS (heartbeats keep flowing during
long forwards), UCX transfers and book-keeping; the loop talks to the engine only through its
commands (``LLMEngine.add_request``, ``abort``...). At rest the thread sleeps on the engine's
command queue: a posted command wakes it, nothing else runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepResult

log = logging.getLogger(__name__)

# Longest sleep between steps when no command arrives. Nothing but a command can create work,
# so this only bounds how long a missed wake-up could last.
IDLE_WAIT = 1.0


class EngineThread:
    """Steps ``engine`` whenever it has work; delivers each step's result to ``loop``."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[StepResult], None],
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.engine.wake()
        self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                result = engine.step()
                if result is None:  # nothing to do, or nothing fits until blocks come back
                    engine.wait_for_work(IDLE_WAIT)
                    continue
                self.loop.call_soon_threadsafe(self.on_step, result)
        except BaseException as exc:  # a dead engine thread must take the worker down loudly
            log.exception("engine thread crashed")
            self.error = exc
            self.loop.call_soon_threadsafe(lambda: None)
