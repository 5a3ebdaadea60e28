"""Where stored responses live: the interface the endpoints use, and the record they keep.

A stored response is the response object as answered, and the conversation it answered (its
``input_items``: the turns before it, when it continued a stored response, then its own input,
each item with an id). ``previous_response_id`` continues it with one read: its input items, then
its output.

The store is NATS JetStream's (``jetstream_store.py``): every gateway replica reads and writes
the same KV bucket, so any of them continues any conversation and a gateway restart loses none.
A store that cannot serve says why (``problem``): a NATS without JetStream is a permanent
condition of the deployment, which a request that explicitly needs the store is told with a 400;
a store that failed for now (NATS down, JetStream not ready in a cluster that is starting) gets
a 503 with ``Retry-After``.
"""

from __future__ import annotations

import hmac
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from pdserve.gateway.errors import APIError, overloaded

STORE_UNAVAILABLE = "response_store_unavailable"
# what a stored response's id may be (a NATS KV key); anything else is not one of ours
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,200}$")


class StoreFailed(Exception):
    """A read, write or delete failed for now (the bus is down, JetStream is not ready)."""


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    input_items: list[dict[str, Any]]  # the conversation it answered, each item with an id
    # The key id (gateway/access.py) of the key that created it: only requests under the same
    # key see it, so tenants cannot read, continue or delete each other's responses. Every
    # request is "anonymous" where no keys are configured.
    owner: str = ""

    def encode(self) -> bytes:
        record = {
            "version": 1,
            "response": self.response,
            "input_items": self.input_items,
            "owner": self.owner,
        }
        return json.dumps(record, ensure_ascii=False).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> StoredResponse:
        """Raises ValueError for bytes that are not a record this gateway wrote."""
        record = json.loads(data)
        if not isinstance(record, dict) or record.get("version") != 1:
            raise ValueError("not a stored response of version 1")
        response, items = record.get("response"), record.get("input_items")
        if not isinstance(response, dict) or not isinstance(items, list):
            raise ValueError("a stored response without its response or input items")
        owner = record.get("owner", "")
        if not isinstance(owner, str):
            raise ValueError("a stored response whose owner is not a key id")
        return cls(response=response, input_items=items, owner=owner)

    def seen_by(self, key_id: str) -> bool:
        return hmac.compare_digest(self.owner, key_id)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response that continues this one starts from: its input, then its output."""
        return [*self.input_items, *self.response.get("output", [])]


class ResponseStore(ABC):
    """Stored responses by id. ``problem`` says why it cannot serve (None: it can);
    ``permanent`` whether that is the deployment's (no JetStream) rather than a passing
    failure."""

    problem: str | None = "the response store has not been opened"
    permanent: bool = False

    @abstractmethod
    async def open(self) -> None:
        """Connect; never raises: what went wrong is ``problem``, logged in one line."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, deleted or expired). Raises StoreFailed."""

    @abstractmethod
    async def put(self, response_id: str, record: StoredResponse) -> None:
        """Store (or replace) a response. Raises StoreFailed."""

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Forget a response; False when there was none. Raises StoreFailed."""

    @property
    def ready(self) -> bool:
        return self.problem is None

    def require(self, param: str | None) -> None:
        """Raise the error for a request that needs the store (``param``: what asked for it)
        while it cannot serve."""
        if self.problem is None:
            return
        if self.permanent:
            raise APIError(400, self.problem, param=param, code=STORE_UNAVAILABLE)
        raise failed(self.problem)


def failed(why: str) -> APIError:
    """The 503 of a store that failed for now."""
    error = overloaded(f"the response store is unavailable: {why}; retry shortly", 2.0)
    error.code = STORE_UNAVAILABLE
    return error
