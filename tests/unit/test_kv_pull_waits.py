"""The waits of a KV pull, with plain futures for UCX's: the puller's one future for its posted
operations (``client._answered``) and the server's end of a transfer (``watch.watch_sends``).
The real exchange runs in tests/integration/test_kv_early_receives.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.shared.kv.transfer import watch
from pdserve.shared.kv.transfer.client import _answered
from pdserve.shared.kv.transfer.lease import LeaseTable
from pdserve.shared.kv.transfer.wire import KVTransferError, pack_reply


def posted(n: int) -> list[asyncio.Future]:
    loop = asyncio.get_running_loop()
    return [loop.create_future() for _ in range(n)]


async def test_a_pull_wakes_once_every_operation_is_done() -> None:
    waits = posted(3)  # request, reply, runs
    reply = pack_reply(None)
    done = _answered(waits, waits[1], reply, time.monotonic() + 5)
    for fut in waits[:2]:  # the reply alone (or with the request) does not wake the puller
        fut.set_result(None)
        await asyncio.sleep(0)
        assert not done.done()
    waits[2].set_result(None)
    await asyncio.wait_for(done, 1)


async def test_a_refusal_waits_for_the_empty_messages_unless_the_server_is_older() -> None:
    waits = posted(3)
    reply = pack_reply("no lease for r1")  # version 2: the empties follow
    done = _answered(waits, waits[1], reply, time.monotonic() + 5)
    waits[1].set_result(None)
    await asyncio.sleep(0)
    assert not done.done()
    waits[0].set_result(None)
    waits[2].set_result(None)
    await asyncio.wait_for(done, 1)

    waits = posted(3)
    reply[0] = 0  # a refusal as servers before version 2 wrote it: no empties will come
    done = _answered(waits, waits[1], reply, time.monotonic() + 5)
    waits[1].set_result(None)
    await asyncio.wait_for(done, 1)
    assert not waits[2].done()  # still posted: the caller must abort the endpoint


async def test_a_failed_operation_or_the_deadline_ends_the_wait() -> None:
    waits = posted(2)
    done = _answered(waits, waits[0], pack_reply(None), time.monotonic() + 5)
    waits[1].set_exception(ConnectionResetError("peer gone"))
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(done, 1)
    waits[0].set_result(None)  # a late completion is seen, not reported as unretrieved

    waits = posted(2)
    done = _answered(waits, waits[0], pack_reply(None), time.monotonic() + 0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(done, 1)


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
