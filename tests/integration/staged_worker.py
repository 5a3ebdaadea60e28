"""A real ``pdserve prefill`` or ``pdserve decode`` worker whose stages a test can slow down while
it runs, so that a request can be caught in one stage on demand (``test_chaos_aborts.py``).

Run as ``python -m tests.integration.staged_worker ROLE`` with the worker's usual ``PDSERVE_*``
environment and ``STAGE_GATES`` naming a folder. A file there holds a delay in seconds; while
it exists the stage it names takes that long (a missing file: no delay); ``WORKER.STAGE`` (the
worker's id first) gates one worker only::

    ROLE.step     every engine step that ran a forward pass sleeps after it (a slow prefill
                  chunk or decode step: the request is seen mid-stage)
    pull_answer   prefill: the KV server answers each admitted pull this late (the lease is
                  pinned, the puller's receives are posted: a pull in flight)
    pull_start    decode: a pull starts this late after the engine reserved its blocks (the
                  request is between its prefill and its pull)

Only timing changes; what the worker computes and sends stays the same. No loopback fault slows
one stage on demand, so the worker's own methods are wrapped here, not in pdserve.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

GATES = Path(os.environ.get("STAGE_GATES", "/nonexistent"))


WORKER = os.environ.get("PDSERVE_WORKER_ID", "")


def delay(stage: str) -> float:
    """The gate of ``stage`` for this worker (``WORKER.stage``), else for every worker."""
    for name in (f"{WORKER}.{stage}", stage):
        try:
            return float((GATES / name).read_text() or 0)
        except (OSError, ValueError):
            continue
    return 0.0


def _slow_steps(role: str) -> None:
    from pdserve.services.engine.engine import LLMEngine

    step = LLMEngine.step

    def slow_step(self: LLMEngine):
        result = step(self)
        if result is not None and result.stats.num_seqs:
            pause = delay(f"{role}.step")
            if pause:
                time.sleep(pause)  # the engine's own thread: commands queue meanwhile
        return result

    LLMEngine.step = slow_step  # type: ignore[method-assign]


def _slow_pull_answers() -> None:
    from pdserve.shared.kv.transfer import KVServer

    answer_now = KVServer._answer_now

    def late_answer(self: KVServer, req, answer):
        pause = delay("pull_answer")
        if not pause:
            return answer_now(self, req, answer)

        async def later() -> None:
            until = time.monotonic() + pause
            while time.monotonic() < until:
                if not isinstance(answer, str) and answer.lease.dropped:
                    # released meanwhile (the puller gave up): as the server ends a transfer
                    # of a dropped lease, the late bytes never go
                    self.leases.unpin(answer.lease)
                    return
                await asyncio.sleep(0.05)
            answer_now(self, req, answer)

        self._spawn(later())
        return None

    KVServer._answer_now = late_answer  # type: ignore[method-assign]


def _slow_pull_starts() -> None:
    from pdserve.services.decode.kv_pulls import KVPulls

    start = KVPulls.start

    def late_start(self: KVPulls, pull) -> None:
        pause = delay("pull_start")
        if not pause:
            return start(self, pull)
        until = time.monotonic() + pause

        def later() -> None:
            # a request that ended meanwhile is told at once, as the worker would have been
            if time.monotonic() >= until or pull.bus_id not in self.worker.states:
                start(self, pull)
            else:
                asyncio.get_running_loop().call_later(0.05, later)

        later()

    KVPulls.start = late_start  # type: ignore[method-assign]


if __name__ == "__main__":
    role = sys.argv[1]
    _slow_steps(role)
    if role == "prefill":
        _slow_pull_answers()
    else:
        _slow_pull_starts()
    from pdserve.cli import main

    sys.exit(main([role]))
