"""What a request in flight reaches of the rest of the gateway, by role: ``RequestPort``, made
once by the ``Dispatcher`` and shared by all its requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdserve.gateway.inflight.departures import Departures
from pdserve.gateway.inflight.outbox import Outbox
from pdserve.gateway.inflight.queue_items import Addressee
from pdserve.gateway.router import Router


class Routes(Protocol):
    """The dispatcher's routing table: the bus ids whose messages go to a request."""

    def register(self, bus_id: str, request: Addressee) -> None: ...
    def unregister(self, bus_id: str) -> None: ...  # and stop counting it on its decode worker


@dataclass(frozen=True)
class RequestPort:
    outbox: Outbox  # sends to workers, and names the inbox they answer on
    router: Router  # picks workers; what a request sends counts as their load until it is done
    departures: Departures  # which workers to skip while our bus recovers; legs migrated away
    routes: Routes  # where the inbox delivers the messages of a bus id
    count_migration: Callable[[str], None]  # one more migration, by reason (a metric)
