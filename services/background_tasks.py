"""A worker's background tasks: publishes, pulls, replies that run beside the event loop's
handlers.

asyncio keeps only weak references to tasks, so a task nobody holds may vanish mid-flight; and
an exception in one nobody awaits is lost. ``BackgroundTasks`` holds each task until it ends and
logs the failures, for every part of a worker that starts one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background, keeping a reference and logging failures."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())
