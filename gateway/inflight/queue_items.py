"""What a request in flight's queue receives besides its workers' answers (``PrefillResult``,
``TokenItem``): the dispatcher's notices of a worker leaving or rejoining and of the gateway's bus
reconnecting, and the timers of its stream checks; how the request waits for the next item;
and what a request is to those who hand it items (``Addressee``).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from pdserve.shared.bus.request_messages import PrefillResult
from pdserve.shared.bus.stream_messages import TokenItem


@dataclass
class WorkerLeft:
    """Put on a request's queue when a worker it waits on leaves the registry."""

    worker_id: str


@dataclass
class WorkerRejoined(WorkerLeft):
    """Put on a request's queue when a worker it waits on says its NATS connection broke and is
    back: what it was sent or sent meanwhile may be lost. To a prefill that is as good as a
    departure (retried elsewhere); decode legs on it are checked (``stream_check.py``)."""


@dataclass
class BusReconnected:
    """Put on every request's queue when the gateway's NATS connection is back after a break:
    whatever was published while it was down (tokens, requests, cancels) may be lost, so
    prefills are sent again elsewhere and decode legs checked (``stream_check.py``)."""

    epoch: int  # the dispatcher's bus epoch since this reconnect


@dataclass
class CheckDue:
    """A timer of a leg's stream check: ask again, or give up (``stream_check.py``)."""

    bus_id: str


Item: TypeAlias = PrefillResult | TokenItem | WorkerLeft | BusReconnected | CheckDue


class Addressee(Protocol):
    """A request in flight as the dispatcher's routing table and ``Departures`` see it: what
    its queue is handed, and which workers' departures and reconnects concern it."""

    @property
    def watching(self) -> set[str]: ...
    def put(self, item: Item) -> None: ...


async def next_item(queue: asyncio.Queue[Item], deadline: float) -> Item | None:
    """The next item of a request's ``queue``, or None once ``deadline`` passed."""
    remaining = deadline - time.time()
    if remaining <= 0:
        return None
    if not queue.empty():  # already here: no timer and no task to wait
        return queue.get_nowait()
    if math.isinf(remaining):
        return await queue.get()  # every limit is off
    try:
        return await asyncio.wait_for(queue.get(), remaining)
    except asyncio.TimeoutError:
        return None
