"""Following a transfer's sends to their end on the server, with callbacks rather than a task.

Over shared memory UCX moves a rendezvous message as fragments copied in by the sender and out
by the receiver, so both processes progress UCX while the KV moves (``UCX_PROTO_INFO``:
"rendezvous fragmented copy-in copy-out", sysv). A task that starts waiting for the sends runs
its first step - futures, ``asyncio.wait``'s set and timer - in the loop turns right after they
are posted, in the middle of that copy; three callbacks and a timer cost a few microseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.shared.kv.transfer.lease import Lease
from pdserve.shared.kv.transfer.wire import ORPHAN_GRACE, KVTransferError, retrieve

Ended = Callable[[BaseException | None], None]


class Transfers:
    """A server's transfers in flight, each followed to its end by one callback on its sends;
    while any runs, a sweep every ``ORPHAN_GRACE / 4`` gives up those whose puller is taken to
    have stopped receiving (``abandoned``). A puller that gave up has cancelled its receives,
    so our sends would wait forever and pin the lease. One timer for all of them: a future, a
    timer and a hook on the lease per transfer cost ~4 us in the loop turns right after its
    sends were posted, in the middle of their copy."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.live: dict[asyncio.Future, tuple[Lease, Ended]] = {}
        self.timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self.live)

    def add(self, sends: asyncio.Future, lease: Lease, ended: Ended) -> None:
        """Follow ``sends`` (of a transfer of ``lease``'s blocks): ``ended`` gets None once they
        are done, or why not - their error, or KVTransferError for an abandoned transfer."""
        self.live[sends] = (lease, ended)
        sends.add_done_callback(self._done)
        if self.timer is None:
            self.timer = sends.get_loop().call_later(ORPHAN_GRACE / 4, self._sweep)

    def _done(self, sends: asyncio.Future) -> None:
        entry = self.live.pop(sends, None)
        if entry is None:  # given up already
            return
        if sends.cancelled():
            entry[1](KVTransferError("the transfer's sends were cancelled"))
        else:
            entry[1](sends.exception())

    def _sweep(self) -> None:
        self.timer = None
        now = self.clock()
        for sends, (lease, ended) in list(self.live.items()):
            if abandoned(lease, now) and not sends.done():
                del self.live[sends]
                sends.add_done_callback(retrieve)  # cancelled with the endpoint, unread
                ended(KVTransferError("the puller stopped receiving"))
        if self.live:
            self.timer = asyncio.get_running_loop().call_later(ORPHAN_GRACE / 4, self._sweep)


def abandoned(lease: Lease, now: float) -> bool:
    """Whether a transfer of ``lease`` counts as abandoned at ``now`` (the lease table's clock):
    ``ORPHAN_GRACE`` after the lease was let go, or after its expiry."""
    if lease.dropped and now >= lease.dropped_at + ORPHAN_GRACE:
        return True
    return now >= lease.expires + ORPHAN_GRACE


def watch_sends(sends: asyncio.Future, lease: Lease, clock: Callable[[], float]) -> asyncio.Future:
    """A future for one transfer's sends (``Transfers``): their outcome, or KVTransferError
    once the puller is taken to have stopped receiving."""
    out = asyncio.get_running_loop().create_future()

    def ended(exc: BaseException | None) -> None:
        if exc is None:
            out.set_result(None)
        else:
            out.set_exception(exc)

    Transfers(clock).add(sends, lease, ended)
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
