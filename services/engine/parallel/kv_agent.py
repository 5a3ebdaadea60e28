"""The KV endpoint of a rank other than 0: its own UCX server (prefill) or client (decode) over
its own shard of the cache, driven by rank 0 through the rank's KV connection.

Each rank moves its own heads: a prefill rank serves them to whichever decode ranks pull, and a
decode rank pulls exactly its heads from the prefill ranks that hold them
(``shared/kv/tp_layout.py``), so the ranks' transfers run in parallel and none gathers
another's KV. Rank 0 keeps deciding everything: it mirrors each lease here before the decode
side may hear of it, and asks for each pull, so only rank 0 ever speaks NATS.

It runs in a thread of its own with an asyncio loop (UCX progresses there), beside the thread
that runs the rank's forward passes, as in the worker process itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.transfer import KVClient, KVServer, LeaseTable
from pdserve.shared.kv.transfer.heads import Split

log = logging.getLogger(__name__)
LEASE_CHECK_SECONDS = 0.25


class KVAgent:
    """Answers rank 0's calls ``(call_id, op, body)`` with ``(call_id, ok, result)``."""

    def __init__(
        self,
        conn: Connection,
        kv_cache: torch.Tensor,
        heads: tuple[int, int],
        split: Split,
        block_size: int,
    ) -> None:
        self.conn = conn
        self.kv_cache = kv_cache
        self.heads = heads
        self.split = split
        self.block_size = block_size
        self.server: KVServer | None = None
        self.client: KVClient | None = None
        self.leases = LeaseTable(lambda _bus_id: None)  # rank 0 frees blocks, not this rank
        self._send_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        threading.Thread(target=asyncio.run, args=(self._serve(),), name="kv", daemon=True).start()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                call_id, op, body = await loop.run_in_executor(None, self.conn.recv)
            except (EOFError, OSError):
                return  # rank 0 is gone; the step loop ends the process
            task = asyncio.create_task(self._answer(call_id, op, body))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, call_id: int, op: str, body: dict) -> None:
        handler = getattr(self, f"op_{op}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown KV call {op!r}")
            reply: tuple[Any, ...] = (call_id, True, await handler(**body))
        except Exception as exc:
            reply = (call_id, False, f"{type(exc).__name__}: {exc}"[:1000])
        with self._send_lock:
            self.conn.send(reply)

    async def op_start(
        self, role: str, fingerprint: dict, host: str, port: int, checksum: bool = False
    ) -> dict:
        """Start this rank's KV endpoint; its pid and the UCX transports this process opened
        (``ucx_check.process_transports``, as rank 0 reads its own), and a KV server's address.
        ``checksum`` (--kv-checksum): a server hashes its shard of each lease mirrored here, a
        client verifies its pulls (``shared/kv/transfer/checksum.py``)."""
        if role == "prefill":
            self.server = KVServer(
                self.kv_cache,
                fingerprint,
                self.leases,
                host=host,
                port=port,
                heads=self.heads,
                split=self.split,
                checksum=checksum,
            )
            await self.server.start()
            asyncio.create_task(self._expire_leases())
            return {"address": self.server.address, **self._facts()}
        self.client = KVClient(
            self.kv_cache,
            fingerprint,
            self.block_size,
            host=host,
            port=port,
            heads=self.heads,
            split=self.split,
            checksum=checksum,
        )
        self.client.own_address()  # a bad host fails now, at start-up
        return self._facts()

    @staticmethod
    def _facts() -> dict:
        return {"pid": os.getpid(), "transports": ucx_check.process_transports()}

    async def _expire_leases(self) -> None:
        # Rank 0 expires the same leases at the same time; this copy only stops serving them.
        while True:
            await asyncio.sleep(LEASE_CHECK_SECONDS)
            self.leases.expire()

    async def op_lease(
        self, bus_id: str, block_ids: list[int], num_tokens: int, expires: float, token: str
    ) -> dict:
        lease = self.leases.add(bus_id, block_ids, num_tokens, expires - time.time())
        lease.token, lease.expires = token, expires  # rank 0's lease, mirrored
        return {}

    async def op_release(self, bus_id: str) -> dict:
        self.leases.release(bus_id)
        return {}

    async def op_pull(
        self,
        bus_id: str,
        handle: dict,
        dst_block_ids: list[int],
        timeout: float,
        address: str,
        heads: list[int],
    ) -> dict:
        if self.client is None:
            raise RuntimeError("this rank has no KV client (not a decode worker)")
        stats = await self.client.pull(
            bus_id,
            KVHandle(**handle),
            dst_block_ids,
            timeout,
            address=address,
            heads=(heads[0], heads[1]),
        )
        return {
            "num_bytes": stats.num_bytes,
            "num_blocks": stats.num_blocks,
            "num_messages": stats.num_messages,
            "seconds": stats.seconds,
            "checksum_seconds": stats.checksum_seconds,
        }
