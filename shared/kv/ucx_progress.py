"""UCX progress and request completion driven by the asyncio loop, at rest on UCX's own file
descriptor.

Two things in ucxx (0.52) busy-wait outside its progress-thread modes, and a worker at rest
burnt a whole core on them:

- its ``blocking`` progress mode arms the worker once. Its reader callback progresses the worker
  but never arms it again, and until ``ucp_worker_arm`` runs the descriptor stays readable, so
  after the first UCX event (a peer connecting) the loop woke for it on every turn;
- ``UCXRequest.wait()`` without the notifier thread is ``while not completed: await
  asyncio.sleep(0)``: every posted operation - a prefill worker's ever-pending receive for pull
  requests, each run of a transfer - keeps the loop turning until it completes.

``ArmedProgress`` replaces both. It follows the protocol UCX documents for ``ucp_worker_arm``:

1. the descriptor fires -> stop watching it, progress the worker, start arming;
2. arming: progress, let every ready asyncio callback run (one may post more UCX work), then
   ``arm()``; it answers False while events are still pending, so repeat;
3. armed -> watch the descriptor again: the loop sleeps in epoll until UCX has news.

Posted operations (``send``, ``recv``, ``worker_recv``) get an asyncio future that the driver
resolves right after the progress call that completed them, so nothing polls a request. A slow
timer (``SAFETY_PROGRESS_SECONDS``) progresses the worker regardless, as ucxx's own mode does,
so UCX keepalives and an event a transport fails to signal are never starved.

``install()`` puts ``ArmedProgress`` in place of ucxx's ``BlockingMode``; it runs before the
first ucxx call of the process (``pdserve.shared.kv.ucx_config.configure`` calls it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdserve.ucx")

SAFETY_PROGRESS_SECONDS = 1.0
_installed = False


@dataclass
class _Posted:
    request: Any  # ucxx UCXRequest
    future: asyncio.Future
    buffer: Any  # kept alive until UCX is done with it, even when the waiter gave up


class ArmedProgress:
    """Progresses one UCX worker from one event loop; see the module docstring."""

    def __init__(self, worker: Any, event_loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = event_loop
        worker.init_blocking_progress_mode()  # creates the descriptor
        self.fd: int = worker.epoll_file_descriptor
        self.watching = False
        self.arming: asyncio.Task | None = None
        self.posted: list[_Posted] = []
        self._start_arming()
        self._timer = event_loop.call_later(SAFETY_PROGRESS_SECONDS, self._safety_progress)
        weakref.finalize(self, _close, event_loop, self.fd, self._timer)

    def track(self, request: Any, buffer: Any) -> asyncio.Future:
        """A future for a posted ``request``, resolved once UCX completes it."""
        posted = _Posted(request, self.loop.create_future(), buffer)
        self.posted.append(posted)
        self._start_arming()  # the operation may need progress before it reaches the wire
        return posted.future

    def progress(self) -> None:
        self.worker.progress()
        if self.posted:
            self._settle()

    def _settle(self) -> None:
        waiting = []
        for posted in self.posted:
            if not posted.request.completed:
                waiting.append(posted)
                continue
            if posted.future.done():  # its waiter gave up (cancelled the future)
                continue
            try:
                posted.request.check_error()
            except Exception as exc:
                posted.future.set_exception(exc)
            else:
                posted.future.set_result(None)
        self.posted = waiting

    def _watch(self) -> None:
        if not self.watching and not self.loop.is_closed():
            self.loop.add_reader(self.fd, self._on_event)
            self.watching = True

    def _unwatch(self) -> None:
        if self.watching:
            self.loop.remove_reader(self.fd)
            self.watching = False

    def _on_event(self) -> None:
        self._unwatch()  # level-triggered: it would fire on every loop turn until armed
        self.progress()
        self._start_arming()

    def _start_arming(self) -> None:
        if self.arming is None or self.arming.done():
            self.arming = self.loop.create_task(self._arm())

    async def _arm(self) -> None:
        while True:
            self.progress()
            # Everything that is ready runs before we arm: a callback that posts a UCX
            # operation after arming would otherwise wait for an unrelated event.
            await asyncio.sleep(0)
            if self.worker.arm():
                self._watch()
                return

    def _safety_progress(self) -> None:
        if self.loop.is_closed():
            return
        self.progress()
        if self.watching:
            # That progress may have consumed events the descriptor was about to report:
            # arm again so that none is left unsignalled.
            self._unwatch()
            self._start_arming()
        self._timer = self.loop.call_later(SAFETY_PROGRESS_SECONDS, self._safety_progress)


def _close(loop: asyncio.AbstractEventLoop, fd: int, timer: asyncio.TimerHandle) -> None:
    timer.cancel()
    if not loop.is_closed():
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)


def install() -> None:
    """Make ucxx's ``blocking`` progress mode use ``ArmedProgress`` (once per process)."""
    global _installed
    if _installed:
        return
    from ucxx._lib_async import application_context

    application_context.BlockingMode = ArmedProgress  # ucxx builds it as (worker, event_loop)
    _installed = True


def driver() -> ArmedProgress:
    """The running loop's progress driver (started on first use)."""
    import ucxx
    from ucxx._lib_async import application_context

    ucxx.continuous_ucx_progress()
    found = application_context.ProgressTasks.get(asyncio.get_running_loop())
    if not isinstance(found, ArmedProgress):
        raise RuntimeError(
            f"UCX progress is {type(found).__name__}, not pdserve's armed mode: "
            "pdserve.shared.kv.ucx_config.configure must run before the first ucxx call"
        )
    return found


def _post(make: Any, buffer: Any) -> asyncio.Future:
    """Post an operation; a failure to post comes back through the future, like a failure
    to complete."""
    from ucxx._lib.arr import Array

    progress = driver()
    try:
        request = make(Array(buffer))
    except Exception as exc:
        failed = progress.loop.create_future()
        failed.set_exception(exc)
        return failed
    return progress.track(request, buffer)


def _open(ep: Any) -> Any:
    """The UCX endpoint under a ucxx ``Endpoint``, or the error that stops using it."""
    from ucxx.exceptions import UCXCloseError

    if ep.closed:
        raise UCXCloseError("Endpoint closed")
    ep._ep.raise_on_error()  # noqa: SLF001 - ucxx keeps the posting API on its raw endpoint
    return ep._ep  # noqa: SLF001


def send(ep: Any, buffer: Any, tag: int) -> asyncio.Future:
    """Send ``buffer`` on ``ep`` with exactly ``tag``."""
    from ucxx.types import Tag

    return _post(lambda arr: _open(ep).tag_send(arr, Tag(tag)), buffer)


def recv(ep: Any, buffer: Any, tag: int) -> asyncio.Future:
    """Receive one message with exactly ``tag`` from ``ep``'s peer into ``buffer``."""
    from ucxx.types import Tag, TagMaskFull

    return _post(lambda arr: _open(ep).tag_recv(arr, Tag(tag), TagMaskFull), buffer)


def worker_recv(buffer: Any, tag: int) -> asyncio.Future:
    """Receive one message with exactly ``tag`` from any peer, endpoint or not."""
    from ucxx.types import Tag

    progress = driver()
    return _post(lambda arr: progress.worker.tag_recv(arr, Tag(tag)), buffer)
