"""Rank 0's calls to the other ranks' KV agents (``kv_agent.py``), awaited on its asyncio loop.

A reader thread per rank turns replies into results of the awaiting futures. A rank that goes
away fails every call still waiting on it, so a pull never hangs on a dead rank.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from multiprocessing.connection import Connection
from typing import Any


class RankCallFailed(RuntimeError):
    """A rank answered a call with an error, or is gone."""


class RankLink:
    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns  # rank r's KV connection at index r - 1
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[int, asyncio.Future]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def size(self) -> int:
        return len(self.conns) + 1

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for rank, conn in enumerate(self.conns, start=1):
            threading.Thread(target=self._read, args=(rank, conn), daemon=True).start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                call_id, ok, result = conn.recv()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._gone, rank)
                return
            self._loop.call_soon_threadsafe(self._done, call_id, ok, result)

    def _done(self, call_id: int, ok: bool, result: Any) -> None:
        entry = self._waiting.pop(call_id, None)
        if entry is None or entry[1].done():
            return
        if ok:
            entry[1].set_result(result)
        else:
            entry[1].set_exception(RankCallFailed(str(result)))

    def _gone(self, rank: int) -> None:
        for call_id, (r, fut) in list(self._waiting.items()):
            if r == rank:
                del self._waiting[call_id]
                if not fut.done():
                    fut.set_exception(RankCallFailed(f"TP rank {rank} is gone"))

    async def call(self, rank: int, op: str, **body: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        call_id = next(self._ids)
        self._waiting[call_id] = (rank, fut)
        try:
            self.conns[rank - 1].send((call_id, op, body))
        except OSError as exc:
            self._waiting.pop(call_id, None)
            raise RankCallFailed(f"TP rank {rank} is gone ({exc!r})") from exc
        try:
            return await fut
        finally:
            self._waiting.pop(call_id, None)

    async def call_all(self, op: str, **body: Any) -> list[Any]:
        """The same call on every rank but 0, concurrently; results by rank (1, 2, ...)."""
        return list(await asyncio.gather(*(self.call(r, op, **body) for r in range(1, self.size))))
