"""What requests in flight send to workers over the bus: prefill and decode requests, cancels,
stream checks and releases of KV leases nobody will pull. A send that must outlive the request
that makes it - a cancel while the client's handler is being cancelled - runs as a task of its
own (``spawn``), which ``close`` waits for on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from pdserve.gateway.inflight.faults import WorkerFailure
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.lease_messages import ReleaseLease
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import StreamCheck

log = logging.getLogger(__name__)


class Outbox:
    """The gateway's sending side of the bus, shared by every request in flight."""

    def __init__(self, bus: Bus, inbox: str) -> None:
        self.bus = bus
        self.inbox = inbox  # the subject workers answer this gateway on
        self._background: set[asyncio.Task] = set()

    async def _publish(self, subject: str, msg, headers: dict[str, str] | None = None) -> None:
        try:
            await self.bus.publish(subject, msg, headers)
        except Exception as exc:  # closed or never-connected bus: fail the request, loudly
            raise WorkerFailure(f"message bus unavailable: {exc}", "bus_unavailable") from exc

    async def send(
        self, worker: str, msg: PrefillRequest | DecodeRequest, headers: dict[str, str]
    ) -> None:
        """Send a request (or a leg of one) to the prefill or decode ``worker``."""
        subjects = self.bus.subjects
        subject = subjects.prefill if isinstance(msg, PrefillRequest) else subjects.decode
        await self._publish(subject(worker), msg, headers)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Fire-and-forget publish that survives the cancellation of the request's task."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    def check_stream(self, worker_id: str, bus_id: str) -> None:
        """Ask ``worker_id`` where the stream ``bus_id`` stands (``stream_check.py``);
        a check that cannot go out now is sent again."""
        check = StreamCheck(bus_id=bus_id, reply_to=self.inbox)
        self.spawn(self._publish(self.bus.subjects.decode(worker_id), check))

    async def cancel(self, bus_id: str, index: int | None = None) -> None:
        """Cancel a request on every worker, or only its choice ``index``."""
        await self._publish(self.bus.subjects.cancel, Cancel(bus_id=bus_id, index=index))

    async def release_stale(self, item: object) -> None:
        """Free the leased KV blocks of a prefill answer nobody will pull."""
        if isinstance(item, PrefillResult) and item.kv is not None:
            await self._publish(
                self.bus.subjects.lease(item.kv.worker_id), ReleaseLease(bus_id=item.bus_id)
            )

    async def close(self) -> None:
        """Give the sends still under way a moment to go out."""
        for task in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 1.0)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background publish failed: %s", task.exception())
