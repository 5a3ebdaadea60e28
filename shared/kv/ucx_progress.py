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
3. armed -> watch the descriptor again: the loop sleeps in epoll until UCX has news - except
   within ``SPIN_SECONDS`` of UCX work, when it keeps progressing instead (see there).

Posted operations (``send``, ``recv``, ``worker_recv``) get an asyncio future that the driver
resolves right after the progress call that completed them, so nothing polls a request. They
are kept by *stream* (direction, endpoint, tag) and each stream is reported in posting order:
a progress call looks at the oldest operation of each stream only, not at every one posted. A
fragmented KV pull posts one receive per block on one tag, and checking all 128 of a 64 MiB
pull after each of its ~3400 progress calls cost more than UCX's progress itself (issue 29).
``send_many``/``recv_many`` post such a run of messages as one batch with one future: posted
one by one, with a future each, 128 receives took ~3 ms of Python on this 2-core VM, as long
as moving their 64 MiB.

A slow timer (``SAFETY_PROGRESS_SECONDS``) progresses the worker regardless, as ucxx's own mode
does, so UCX keepalives and an event a transport fails to signal are never starved.

``install()`` puts ``ArmedProgress`` in place of ucxx's ``BlockingMode``; it runs before the
first ucxx call of the process (``pdserve.shared.kv.ucx_config.configure`` calls it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SAFETY_PROGRESS_SECONDS = 1.0
# After posting an operation or completing one, keep progressing this long before sleeping in
# epoll: the peer's answer usually comes within it. A KV pull is a chain of hops (request,
# reply, rendezvous, data), and each one the loop slept through cost a wake-up from epoll on a
# cold CPU - on this 2-core VM a 1 MiB pull took ~1.0 ms with a sleep per hop, ~0.45 ms with
# this window (issue 29). Only UCX work opens it; a wake-up alone (a keepalive) does not, so a
# worker at rest still never spins.
SPIN_SECONDS = 200e-6
_installed = False
_last: ArmedProgress | None = None  # the driver ``driver()`` found last
_progress_tasks: dict = {}  # ucxx's drivers by event loop, once ``driver()`` has looked
Stream = tuple[str, Any, int]  # "send"/"recv", the endpoint (None: any peer), the tag


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
        self.posted: dict[Stream | object, deque[_Posted]] = {}
        self.busy_until = 0.0
        self._start_arming()
        self._timer = event_loop.call_later(SAFETY_PROGRESS_SECONDS, self._safety_progress)
        weakref.finalize(self, _close, event_loop, self.fd, self._timer)

    def track(self, request: Any, buffer: Any, stream: Stream | None = None) -> asyncio.Future:
        """A future for a posted ``request``, resolved once UCX completes it and every
        operation posted before it on ``stream`` (None: a stream of its own)."""
        posted = _Posted(request, self.loop.create_future(), buffer)
        self.posted.setdefault(object() if stream is None else stream, deque()).append(posted)
        self.busy_until = self.loop.time() + SPIN_SECONDS
        self._start_arming()  # the operation may need progress before it reaches the wire
        return posted.future

    def progress(self) -> None:
        self.worker.progress()
        if self.posted:
            self._settle()

    def _settle(self) -> None:
        resolved = 0
        finished = []
        for stream, queue in self.posted.items():
            before = len(queue)
            if not _settle_stream(queue):
                finished.append(stream)
            resolved += before - len(queue)
        for stream in finished:
            del self.posted[stream]
        if resolved:  # its waiter will likely post the next step of the exchange
            self.busy_until = self.loop.time() + SPIN_SECONDS

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
            if self.loop.time() < self.busy_until:
                continue
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


def _settle_stream(queue: deque[_Posted]) -> bool:
    """Resolve the futures of a stream's completed operations, oldest first, up to the first
    one still running; whether any is left. An operation whose waiter gave up (cancelled its
    future) may never complete - a stopped server's receive - so it is stepped over."""
    i = 0
    while i < len(queue):
        posted = queue[i]
        if not posted.request.completed:
            if not posted.future.done():
                break
            i += 1  # abandoned, still UCX's: its buffer stays referenced until it completes
            continue
        del queue[i]
        if posted.future.done():
            continue
        try:
            posted.request.check_error()
        except Exception as exc:
            posted.future.set_exception(exc)
        else:
            posted.future.set_result(None)
    return bool(queue)


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
    global _last, _progress_tasks
    loop = asyncio.get_running_loop()
    # every post asks: one lookup in ucxx's table (cleared, never replaced, when ucxx resets)
    # instead of its continuous_ucx_progress and context lookups
    if _last is not None and _progress_tasks.get(loop) is _last:
        return _last
    import ucxx
    from ucxx._lib_async import application_context

    ucxx.continuous_ucx_progress()
    found = application_context.ProgressTasks.get(asyncio.get_running_loop())
    if not isinstance(found, ArmedProgress):
        raise RuntimeError(
            f"UCX progress is {type(found).__name__}, not pdserve's armed mode: "
            "pdserve.shared.kv.ucx_config.configure must run before the first ucxx call"
        )
    _last, _progress_tasks = found, application_context.ProgressTasks
    return found


class _API:
    """ucxx's posting types, imported on first use (after ``install``) and kept: an import
    statement in every post cost ~1 us of a ~10 us post."""

    Array: Any = None
    Tag: Any = None
    TagMaskFull: Any = None
    UCXCloseError: Any = None

    @classmethod
    def load(cls) -> type[_API]:
        if cls.Array is None:
            from ucxx._lib.arr import Array
            from ucxx.exceptions import UCXCloseError
            from ucxx.types import Tag, TagMaskFull

            cls.Tag, cls.TagMaskFull, cls.UCXCloseError = Tag, TagMaskFull, UCXCloseError
            cls.Array = Array
        return cls


def _post(make: Any, buffer: Any, stream: Stream) -> asyncio.Future:
    """Post an operation; a failure to post comes back through the future, like a failure
    to complete."""
    progress = driver()
    try:
        request = make(_API.load().Array(buffer))
    except Exception as exc:
        failed = progress.loop.create_future()
        failed.set_exception(exc)
        return failed
    return progress.track(request, buffer, stream)


class _Batch:
    """Operations posted together, seen by the driver as one request: completed once all
    are, which it learns by looking at the first one still running. Each one's status is
    read as it is passed, not all at the end: 130 of a fragmented pull cost ~50 us of Python
    between its last byte and its waiter's wake-up."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests
        self.done = 0  # requests[:done] have completed
        self.failed: Any = None  # the first of those that failed

    @property
    def completed(self) -> bool:
        return self._advance() == len(self.requests)

    def _advance(self) -> int:
        """Pass the requests completed since last time; how many have."""
        requests, done = self.requests, self.done
        while done < len(requests) and requests[done].completed:
            if self.failed is None and requests[done].status:  # UCS_OK is 0
                self.failed = requests[done]
            done += 1
        self.done = done
        return done

    def check_error(self) -> None:
        if self.failed is not None:
            self.failed.check_error()


def _post_many(ep: Any, kind: str, buffers: list[Any], tags: list[int]) -> asyncio.Future:
    """Post a ``kind`` ("send"/"recv") of each buffer on ``ep`` with exactly its tag, in order;
    one future for them all. A failure to post comes back through it; the operations posted
    before that stay tracked (their buffers held) until they complete - the caller aborts the
    endpoint, which completes them."""
    api = _API.load()
    progress = driver()
    stream = (kind, ep, tags[0] if tags else 0)
    requests: list[Any] = []
    try:
        raw = _open(ep)
        utags = {tag: api.Tag(tag) for tag in set(tags)}
        array = api.Array
        for buf, tag in zip(buffers, tags, strict=True):
            arr = buf if type(buf) is array else array(buf)
            requests.append(
                raw.tag_send(arr, utags[tag])
                if kind == "send"
                else raw.tag_recv(arr, utags[tag], api.TagMaskFull)
            )
    except Exception as exc:
        if requests:  # nobody waits for these, but UCX still owns their buffers
            progress.track(_Batch(requests), buffers, stream).cancel()
        failed = progress.loop.create_future()
        failed.set_exception(exc)
        return failed
    return progress.track(_Batch(requests), buffers, stream)


def array(buffer: Any) -> Any:
    """``buffer`` as the ucxx ``Array`` a post takes: built once, it can be posted again and
    again (``send_many``, ``recv_many`` and ``ucx_exchange.exchange`` take it as it is) - ~1 us
    a message saved where the same buffers travel every time, a KV cache's blocks (issue 29)."""
    return _API.load().Array(buffer)


def send_many(ep: Any, buffers: list[Any], tag: int | list[int]) -> asyncio.Future:
    """Send each of ``buffers`` (or its ``array``) on ``ep`` with exactly ``tag`` (or the tag
    at its place in a list of them), in order (the peer's receives on a tag match its messages
    in this order); done when all are. One call for a transfer's runs and its reply: each post
    apart cost ~8 us of Python, while UCX waits for this process to copy the data along."""
    return _post_many(ep, "send", buffers, tag if isinstance(tag, list) else [tag] * len(buffers))


def recv_many(ep: Any, buffers: list[Any], tag: int) -> asyncio.Future:
    """Receive ``len(buffers)`` messages with exactly ``tag`` from ``ep``'s peer, in order,
    one into each buffer; done when all have arrived."""
    return _post_many(ep, "recv", buffers, [tag] * len(buffers))


def _open(ep: Any) -> Any:
    """The UCX endpoint under a ucxx ``Endpoint``, or the error that stops using it."""
    if ep.closed:
        raise _API.load().UCXCloseError("Endpoint closed")
    ep._ep.raise_on_error()  # noqa: SLF001 - ucxx keeps the posting API on its raw endpoint
    return ep._ep  # noqa: SLF001


def send(ep: Any, buffer: Any, tag: int) -> asyncio.Future:
    """Send ``buffer`` on ``ep`` with exactly ``tag``."""
    return _post(lambda arr: _open(ep).tag_send(arr, _API.Tag(tag)), buffer, ("send", ep, tag))


def recv(ep: Any, buffer: Any, tag: int) -> asyncio.Future:
    """Receive one message with exactly ``tag`` from ``ep``'s peer into ``buffer``."""
    return _post(
        lambda arr: _open(ep).tag_recv(arr, _API.Tag(tag), _API.TagMaskFull),
        buffer,
        ("recv", ep, tag),
    )


def worker_recv(buffer: Any, tag: int) -> asyncio.Future:
    """Receive one message with exactly ``tag`` from any peer, endpoint or not."""
    progress = driver()
    return _post(
        lambda arr: progress.worker.tag_recv(arr, _API.Tag(tag)), buffer, ("recv", None, tag)
    )
