"""A response store in one dict, for the model-free tier, which starts no nats-server: the
endpoints' behaviour against the store's interface (``gateway/responses/store.py``). The real
store, JetStream's, is tested against real nats-servers in
``tests/integration/test_responses_store.py``. Records go through the same encoding as there,
so what a test reads back is what JetStream would hold."""

from __future__ import annotations

from pdserve.gateway.responses.store import ResponseStore, StoredResponse, StoreFailed


class MemoryResponseStore(ResponseStore):
    def __init__(self, problem: str | None = None, permanent: bool = True) -> None:
        self._records: dict[str, bytes] = {}
        self._problem_after_open = problem
        self.permanent = permanent
        self.failing = False  # true: every read and write fails (a bus that is down)
        self.puts = 0

    async def open(self) -> None:
        self.problem = self._problem_after_open

    async def close(self) -> None:
        pass

    def _check(self) -> None:
        if self.failing:
            raise StoreFailed("the bus is down")

    async def get(self, response_id: str) -> StoredResponse | None:
        self._check()
        data = self._records.get(response_id)
        return StoredResponse.decode(data) if data is not None else None

    async def put(self, response_id: str, record: StoredResponse) -> None:
        self._check()
        self.puts += 1
        self._records[response_id] = record.encode()

    async def delete(self, response_id: str) -> bool:
        self._check()
        return self._records.pop(response_id, None) is not None
