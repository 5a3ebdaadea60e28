"""The puller posts every receive before it asks (KV wire version 2): a refusal must leave no
receive pointing into its blocks and the connection usable, the KV must still land exactly, and
what a server cannot complete must be aborted, never left posted."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
import torch

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.transfer import KVClient, KVTransferError
from pdserve.shared.kv.transfer import server as server_module
from pdserve.shared.kv.transfer.request import (
    SLICED,
    WHOLE,
    PullRequest,
    decode_request,
    encode_request,
    request_prefix,
)
from pdserve.shared.kv.transfer.server import Refusal
from pdserve.shared.kv.transfer.wire import KV_WIRE_VERSION, REPLY_BYTES
from tests.integration.kv_peer import BLOCK, peer_cache
from tests.integration.test_kv_transfer import Pair, cache, fingerprint, peer


def _older_refusal(error: str | None, sliced: bool = False, sums: int = 0) -> np.ndarray:
    """A refusal as a server from before version 2 wrote it: no version, reason from byte 1."""
    out = np.zeros(REPLY_BYTES, dtype=np.uint8)
    text = (error or "").encode()
    out[1 : 1 + len(text)] = np.frombuffer(text, dtype=np.uint8)
    return out


async def test_a_refusal_completes_the_posted_receives_and_keeps_the_connection() -> None:
    """Between two processes: the server refuses blocks outside the lease after the puller's
    receives into its blocks are posted. Empty messages complete them: nothing lands, the
    refusal arrives at once (not at the timeout), and the same endpoint serves the next pull."""
    dst = cache(fill=-1.0)
    client = KVClient(dst, fingerprint(), BLOCK)
    with peer([4, 5, 6]) as (_, handle):
        await client.pull("r1", handle, [10, 11, 12])
        ((_, ep),) = client.endpoints.eps.items()
        dst[10:13] = -1.0
        beyond = KVHandle(**{**handle.__dict__, "block_ids": [4, 5, 7]})  # 7 is not leased
        t0 = time.monotonic()
        for _ in range(3):
            with pytest.raises(KVTransferError, match="not part of the lease"):
                await client.pull("r1", beyond, [10, 11, 12], timeout=20.0)
        assert time.monotonic() - t0 < 5.0  # answered, not timed out
        assert (dst == -1).all()
        ((_, still),) = client.endpoints.eps.items()
        assert still is ep and not ep.closed  # no abort: concurrent pulls on it live on
        await client.pull("r1", handle, [10, 11, 12])
        assert torch.equal(dst[10:13], peer_cache()[4:7])
    await client.close()


async def test_a_refusal_that_leaves_receives_posted_aborts_and_reconnects(monkeypatch) -> None:
    """A server that does not complete the posted receives (one from before version 2) makes
    the puller abort its endpoint, which cancels them; the next pull connects anew and works."""
    async with Pair() as p:
        good = p.lease("r1", [0, 1], 2 * BLOCK)
        await p.client.pull("r1", good, [5, 6])
        ((_, ep),) = p.client.endpoints.eps.items()
        p.dst[5:7] = -1.0
        monkeypatch.setattr(server_module, "pack_reply", _older_refusal)
        monkeypatch.setattr(p.server, "_empties", lambda *args: [])
        beyond = KVHandle(**{**good.__dict__, "block_ids": [0, 2]})
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="not part of the lease"):
            await p.client.pull("r1", beyond, [5, 6], timeout=20.0)
        assert time.monotonic() - t0 < 5.0
        assert ep.closed and len(p.client.endpoints) == 0  # aborted: nothing left posted
        monkeypatch.undo()
        await p.client.pull("r1", good, [5, 6])
        assert torch.equal(p.dst[5:7], p.src[0:2])


async def test_a_refusal_with_unfinished_receives_is_aborted_at_the_deadline(monkeypatch) -> None:
    """A version-2 refusal whose empty messages never come: the pull ends at its deadline with
    the endpoint aborted, and the lease still serves the next pull."""
    async with Pair() as p:
        good = p.lease("r1", [0, 1], 2 * BLOCK)
        monkeypatch.setattr(p.server, "_empties", lambda *args: [])
        beyond = KVHandle(**{**good.__dict__, "block_ids": [0, 2]})
        with pytest.raises(KVTransferError, match="timed out"):
            await p.client.pull("r1", beyond, [5, 6], timeout=0.5)
        assert len(p.client.endpoints) == 0
        monkeypatch.undo()
        await p.client.pull("r1", good, [5, 6])
        assert torch.equal(p.dst[5:7], p.src[0:2])


def _request(flags: int = WHOLE, heads=(0, 2), **entries) -> PullRequest:
    """A pull of blocks 0-1 of r1 as a puller sends it, decoded as the server does; ``entries``
    replace what the map carries."""
    body = encode_request(
        request_prefix(b"puller", fingerprint()), "r1", "t", 8, flags, heads, (0, 0), [(0, 5, 2)]
    )
    entries = {**msgpack.unpackb(body[4:]), **entries}
    return decode_request(msgpack.packb({k: v for k, v in entries.items() if v is not None}))


async def test_the_server_answers_only_its_own_version_and_the_form_it_can_send() -> None:
    async with Pair() as p:
        p.lease("r1", [0, 1], 2 * BLOCK)
        lease = p.leases.get("r1")
        answer = p.server.admission.admit(_request())
        assert answer.lease is lease and lease.pins == 1 and not answer.sliced
        p.leases.unpin(lease)
        with pytest.raises(Refusal, match="wire version None"):  # a puller from before v2
            p.server.admission.admit(_request(v=None))
        older = {"fingerprint": fingerprint(), "runs": [[0, 2]], "heads": [0, 2], "whole": True}
        with pytest.raises(Refusal, match=f"wire version 2; this server speaks {KV_WIRE_VERSION}"):
            p.server.admission.admit(
                _request(v=2, fp=None, pull=None, **older)
            )  # as version 2 asked
        with pytest.raises(Refusal, match="malformed pull request"):
            p.server.admission.admit(_request(pull=b"\x01\x00"))
        with pytest.raises(Refusal, match="KV layout mismatch"):
            p.server.admission.admit(_request(fp=msgpack.packb({**fingerprint(), "num_layers": 3})))
        with pytest.raises(Refusal, match="malformed fingerprint"):
            p.server.admission.admit(_request(fp=b"\xc1"))
        with pytest.raises(Refusal, match="whole blocks asked"):  # only part of our heads
            p.server.admission.admit(_request(heads=(0, 1)))
        assert lease.pins == 0
        answer = p.server.admission.admit(
            _request(WHOLE | SLICED)
        )  # slices of a float cache: any time
        assert answer.sliced and lease.pins == 1
        p.leases.unpin(lease)


async def test_a_served_pull_unpins_its_lease_without_a_task() -> None:
    """The server follows a transfer by callbacks (watch.py), not a task: once the sends are
    done the lease is unpinned, and a release then frees the blocks at once."""
    async with Pair() as p:
        handle = p.lease("r1", list(range(16)), 16 * BLOCK)
        lease = p.leases.get("r1")
        await p.client.pull("r1", handle, list(range(16, 32)))
        for _ in range(100):  # the server's completion may trail the puller's by a loop turn
            if lease.pins == 0:
                break
            await asyncio.sleep(0.01)
        assert lease.pins == 0 and len(p.server.transfers) == 0
        assert not p.server._requests  # no task was left behind
        assert p.leases.release("r1") and p.freed == ["r1"]
        assert p.server.pulls_served == 1 and p.server.pulls_aborted == 0
