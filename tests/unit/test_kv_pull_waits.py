"""The waits of a KV pull, with stand-ins for UCX's requests: the puller's one future for its
request and posted receives (``ucx_exchange``) and the server's end of a transfer
(``watch.Transfers``). The real exchange runs in tests/integration/test_kv_early_receives.py."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from pdserve.shared.kv import ucx_exchange
from pdserve.shared.kv.transfer import watch
from pdserve.shared.kv.transfer.lease import LeaseTable
from pdserve.shared.kv.transfer.wire import (
    REPLY_REFUSED_2,
    KVTransferError,
    pack_reply,
    reply_leaves_posted,
)
from pdserve.shared.kv.ucx_progress import _Posted, _settle_stream
from tests.unit.test_ucx_progress import Request


def exchange(n: int, early=None) -> tuple[deque[_Posted], list[Request], asyncio.Future]:
    """A request's send and ``n - 1`` receives, as the driver follows them."""
    requests = [Request() for _ in range(n)]
    batch = ucx_exchange.Exchange(requests, early)
    batch.future = asyncio.get_running_loop().create_future()
    return deque([_Posted(batch, batch.future, bytearray(8))]), requests, batch.future


def posted(n: int) -> list[asyncio.Future]:
    loop = asyncio.get_running_loop()
    return [loop.create_future() for _ in range(n)]


async def test_a_pull_wakes_once_every_operation_is_done() -> None:
    queue, requests, done = exchange(3)  # request, reply, runs
    for request in requests[:2]:  # the reply alone (or with the request) does not wake it
        request.done = True
        assert _settle_stream(queue) and not done.done()
    requests[2].done = True
    assert not _settle_stream(queue)
    assert done.result() is None


async def test_a_refusal_waits_for_the_empty_messages_unless_the_server_speaks_another_version():
    reply = pack_reply("no lease for r1")  # this version: the empties follow
    queue, requests, done = exchange(3, lambda: reply_leaves_posted(reply))
    requests[0].done = requests[1].done = True
    assert _settle_stream(queue) and not done.done()
    requests[2].done = True
    assert not _settle_stream(queue) and done.done()

    for first in (0, REPLY_REFUSED_2):  # servers before version 2, and of version 2
        reply[0] = first
        queue, requests, done = exchange(3, lambda: reply_leaves_posted(reply))
        requests[0].done = requests[1].done = True
        assert _settle_stream(queue) and done.done()  # at once: no empties will come
        assert len(queue) == 1  # still posted, its buffers held, until the abort completes it
        requests[2].done = True
        assert not _settle_stream(queue)


async def test_a_failed_send_or_operation_ends_the_wait() -> None:
    queue, requests, done = exchange(3)
    requests[0].done, requests[0].error = True, ConnectionResetError("peer gone")
    assert _settle_stream(queue)  # the receives stay posted (the caller aborts)
    with pytest.raises(ConnectionResetError):
        done.result()

    queue, requests, done = exchange(3)
    for request in requests:
        request.done = True
    requests[2].error = ValueError("message truncated")
    assert not _settle_stream(queue)
    with pytest.raises(ValueError, match="truncated"):
        done.result()


async def test_the_deadline_ends_the_wait_and_the_operations_stay_held() -> None:
    from pdserve.shared.kv.transfer.client import _expire

    queue, requests, done = exchange(2)
    _expire(done)
    with pytest.raises(TimeoutError):
        done.result()
    assert _settle_stream(queue)  # stepped over, not dropped: UCX still owns the buffers
    requests[0].done = requests[1].done = True
    assert not _settle_stream(queue)


async def test_a_transfer_ends_with_its_sends_or_when_its_puller_is_gone(monkeypatch) -> None:
    monkeypatch.setattr(watch, "ORPHAN_GRACE", 0.05)
    leases = LeaseTable(lambda rid: None)
    lease = leases.add("r1", [1, 2], 32, ttl=30)
    (sends,) = posted(1)
    watched = watch.watch_sends(sends, lease, leases.clock)
    sends.set_result(None)
    await asyncio.wait_for(watched, 1)
    assert lease.on_drop == []  # nothing left hooked on the lease

    (sends,) = posted(1)
    watched = watch.watch_sends(sends, lease, leases.clock)
    await asyncio.sleep(0.1)
    assert not watched.done()  # a live lease: the sends may still finish
    leases.release("r1")
    with pytest.raises(KVTransferError, match="stopped receiving"):
        await asyncio.wait_for(watched, 1)

    expired = leases.add("r2", [3], 16, ttl=-1.0)  # long past its expiry, never released
    (sends,) = posted(1)
    with pytest.raises(KVTransferError, match="stopped receiving"):
        await asyncio.wait_for(watch.watch_sends(sends, expired, leases.clock), 1)
