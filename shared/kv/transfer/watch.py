"""Following a transfer's sends to their end on the server, with callbacks rather than a task.

Over shared memory UCX moves a rendezvous message as fragments copied in by the sender and out
by the receiver, so both processes progress UCX while the KV moves (``UCX_PROTO_INFO``:
"rendezvous fragmented copy-in copy-out", sysv). A task that starts waiting for the sends runs
its first step - futures, ``asyncio.wait``'s set and timer - in the loop turns right after they
are posted, in the middle of that copy; three callbacks and a timer cost a few microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from pdserve.shared.kv.transfer.lease import Lease
from pdserve.shared.kv.transfer.wire import ORPHAN_GRACE, KVTransferError, retrieve


def watch_sends(sends: asyncio.Future, lease: Lease, clock: Callable[[], float]) -> asyncio.Future:
    """A future for a transfer's sends: their outcome, or KVTransferError once the puller is
    taken to have stopped receiving. A puller that gave up has cancelled its receives, so our
    sends would wait forever and pin the lease: once the lease is let go (or ``ORPHAN_GRACE``
    past its expiry, ``clock``'s time), ``ORPHAN_GRACE`` later the transfer counts as
    abandoned."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()
    timer: asyncio.TimerHandle | None = None

    def finish(abandoned: bool = False) -> None:
        if out.done():
            return
        if timer is not None:
            timer.cancel()
        with contextlib.suppress(ValueError):
            lease.on_drop.remove(on_drop)
        if abandoned and not sends.done():
            sends.add_done_callback(retrieve)  # cancelled with the endpoint, unread
            out.set_exception(KVTransferError("the puller stopped receiving"))
        elif sends.cancelled():
            out.set_exception(KVTransferError("the transfer's sends were cancelled"))
        elif sends.exception() is not None:
            out.set_exception(sends.exception())
        else:
            out.set_result(None)

    def on_drop() -> None:
        nonlocal timer
        if timer is not None:
            timer.cancel()
        timer = loop.call_later(ORPHAN_GRACE, finish, True)

    expiry = max(0.0, lease.expires - clock()) + ORPHAN_GRACE
    timer = loop.call_later(expiry, finish, True)
    lease.on_drop.append(on_drop)
    if lease.dropped:
        on_drop()
    sends.add_done_callback(lambda _: finish())
    return out


def done_or_after(fut: asyncio.Future, seconds: float) -> asyncio.Future:
    """A future done when ``fut`` is or ``seconds`` have passed, whichever comes first."""
    loop = fut.get_loop()
    out = loop.create_future()

    def go(*_: object) -> None:
        if not out.done():
            out.set_result(None)

    timer = loop.call_later(seconds, go)
    out.add_done_callback(lambda _: timer.cancel())
    fut.add_done_callback(go)
    return out
