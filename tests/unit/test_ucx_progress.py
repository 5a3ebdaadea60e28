"""How the UCX progress driver reports completed operations: per stream, oldest first, looking
at each stream's oldest running operation only (issue 29: a fragmented pull's 128 receives were
all checked after every progress call). UCX requests are stand-ins here; the real ones run in
tests/integration (test_kv_transfer, test_kv_shm, test_idle)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from pdserve.shared.kv import ucx_progress
from pdserve.shared.kv.ucx_progress import ArmedProgress, _Posted, _settle_stream


class Request:
    """What the driver reads of a ucxx request: ``completed``, ``status``, ``check_error()``."""

    def __init__(self) -> None:
        self.done = False
        self.error: Exception | None = None
        self.checks = 0  # how often the driver asked

    @property
    def completed(self) -> bool:
        self.checks += 1
        return self.done

    @property
    def status(self) -> int:  # UCS_OK (0) or an error (a batch reads it as it passes one)
        return 0 if self.error is None else -1

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


def stream(loop: asyncio.AbstractEventLoop, n: int) -> tuple[deque[_Posted], list[Request]]:
    requests = [Request() for _ in range(n)]
    return deque(_Posted(r, loop.create_future(), bytearray(8)) for r in requests), requests


async def test_a_stream_is_reported_in_posting_order() -> None:
    queue, requests = stream(asyncio.get_running_loop(), 3)
    futures = [p.future for p in queue]
    requests[1].done = True  # finished behind a running one: told with it
    assert _settle_stream(queue)
    assert [f.done() for f in futures] == [False, False, False]
    requests[0].done = True
    assert _settle_stream(queue)
    assert [f.done() for f in futures] == [True, True, False] and len(queue) == 1
    requests[2].done = True
    assert not _settle_stream(queue)
    assert all(f.result() is None for f in futures)


async def test_only_the_oldest_running_operation_is_looked_at() -> None:
    queue, requests = stream(asyncio.get_running_loop(), 128)
    for _ in range(10):
        _settle_stream(queue)
    assert requests[0].checks == 10 and sum(r.checks for r in requests[1:]) == 0


async def test_an_abandoned_operation_is_stepped_over_but_kept() -> None:
    """A waiter that gave up (a stopped server's receive) never blocks the stream, and its
    buffer stays referenced until UCX completes the operation."""
    queue, requests = stream(asyncio.get_running_loop(), 2)
    first, second = queue[0], queue[1]
    first.future.cancel()
    requests[1].done = True
    assert _settle_stream(queue)
    assert second.future.done() and list(queue) == [first]
    requests[0].done = True
    assert not _settle_stream(queue)


async def test_a_failed_operation_fails_its_future() -> None:
    queue, requests = stream(asyncio.get_running_loop(), 2)
    futures = [p.future for p in queue]
    requests[0].done = requests[1].done = True
    requests[0].error = ConnectionResetError("peer gone")
    assert not _settle_stream(queue)
    with pytest.raises(ConnectionResetError):
        futures[0].result()
    assert futures[1].result() is None


async def test_the_driver_keeps_streams_apart_and_drops_finished_ones() -> None:
    loop = asyncio.get_running_loop()
    driver = object.__new__(ArmedProgress)  # no UCX worker: only the bookkeeping
    driver.posted, driver.loop, driver.busy_until = {}, loop, 0.0
    reply, data = stream(loop, 1), stream(loop, 2)
    driver.posted[("recv", "ep", 11)] = reply[0]
    driver.posted[("recv", "ep", 12)] = data[0]
    ucx_progress.ArmedProgress._settle(driver)
    assert driver.busy_until == 0.0  # nothing completed: no reason to keep progressing
    data[1][0].done = True
    ucx_progress.ArmedProgress._settle(driver)
    assert list(driver.posted) == [("recv", "ep", 11), ("recv", "ep", 12)]
    assert driver.busy_until > loop.time()  # a completion opens the spin window
    reply[1][0].done = True
    ucx_progress.ArmedProgress._settle(driver)
    assert list(driver.posted) == [("recv", "ep", 12)]
