"""A worker's periodic look at its requests and its engine: deadlines, a dead engine thread.

Every ``HOUSEKEEPING_SECONDS`` the watch fails the requests whose deadline passed before their
first token (queued, pulling, prefilling), and when the engine thread died it fails every
request (or, when a TP rank was lost, leaves them to gateways that migrate them) and stops the
worker. The role's own checks (``Worker.housekeeping``: lease expiry...) and the metrics follow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.engine_thread import EngineThread
from pdserve.services.request_state import RequestState
from pdserve.services.worker_report import WorkerReport
from pdserve.shared.telemetry.health import Health

log = logging.getLogger(__name__)

HOUSEKEEPING_SECONDS = 0.25  # deadline and lease checks


class WatchedWorker(Protocol):
    """What the watch needs of ``services.worker_base.Worker``."""

    role: str
    states: dict[str, RequestState]
    engine: LLMEngine | None
    engine_thread: EngineThread | None
    health: Health
    report: WorkerReport
    stopping: asyncio.Event  # set: the worker stops serving (and drains)

    async def fail(self, state: RequestState, code: str, text: str) -> None: ...

    async def housekeeping(self) -> None: ...


class RequestWatch:
    def __init__(self, worker: WatchedWorker) -> None:
        self.worker = worker

    async def run(self) -> None:
        """Look every ``HOUSEKEEPING_SECONDS`` until the worker must stop."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            self.worker.health.tick()
            if not await self.check():
                return

    async def check(self) -> bool:
        """Deadlines (of requests without a first token yet: queued, pulling, prefilling), a
        dead engine thread, the role's housekeeping. False: the worker must stop."""
        worker = self.worker
        thread = worker.engine_thread
        if thread is not None and thread.error is not None:
            ranks = worker.engine.ranks if worker.engine is not None else None
            lost = ranks.failure if ranks is not None else None
            if lost is not None:  # as if this worker died: gateways migrate its streams
                log.error("%s; leaving with %d requests for others", lost, len(worker.states))
                worker.stopping.set()
                return False
            log.error("engine thread died; failing %d requests and stopping", len(worker.states))
            error = f"the {worker.role} worker's engine failed: {thread.error!r}"
            for state in list(worker.states.values()):
                await worker.fail(state, "internal", error[:500])
            worker.stopping.set()
            return False
        now = time.time()
        for state in [s for s in worker.states.values() if s.deadline < now and not s.started]:
            if worker.states.get(state.bus_id) is state:
                log.warning("request %s passed its deadline", state.bus_id)
                why = f"request deadline passed before its first token ({worker.role})"
                await worker.fail(state, "deadline", why)
        await worker.housekeeping()
        worker.report.update_metrics()
        return True
