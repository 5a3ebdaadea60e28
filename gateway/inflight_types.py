"""What flows through a request in flight: the faults it may end with, the events it yields to
its consumer, the choices it tracks, and the items its queue receives (``gateway/inflight.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.shared.bus.protocol import PrefillResult, TokenItem
from pdserve.shared.logprobs import TokenLogprobs

PREFILL_ATTEMPTS = 3  # prefill is idempotent: a dead or overloaded worker's request goes elsewhere
DECODE_ATTEMPTS = 3  # a decode worker that refuses a request before its first token
RETRYABLE_CODES = ("overloaded", "draining")
TYPICAL_OUTPUT_TOKENS = 256
DEFAULT_MAX_MIGRATIONS = 3  # a request's re-dispatches after losing its decode worker
# why a request was migrated (the reason label of pdserve_request_migrations_total)
MIGRATE_WORKER_LOST = "worker_lost"  # its decode worker left the registry (gone, or dead)
# tokens of its stream were lost on the bus: a gap in their positions, or a check after a NATS
# reconnect found the stream over or unknown on its worker, or unanswered (gateway/stream_check.py)
MIGRATE_BUS_RECONNECT = "bus_reconnect"
# The latest deadline a message carries when no limit applies: the wire's bound is 1e12 (a
# deadline is a Unix time) and infinity is not JSON; this is the year 5138.
WIRE_NO_DEADLINE = 1e11
# How long a leg migrated away after it streamed is remembered, to cancel it again if its worker
# turns up: such a leg has no deadline on its worker, which would run it to its end.
ABANDONED_STREAM_SECONDS = 3600.0


def due_in(seconds: float) -> float:
    """The time ``seconds`` from now, or never when the limit is off (0)."""
    return time.time() + seconds if seconds > 0 else math.inf


def on_wire(deadline: float) -> float:
    return min(deadline, WIRE_NO_DEADLINE)


class NoWorker(Exception):
    """No worker can take the request now (answer 503 with Retry-After)."""


class NotSendable(Exception):
    """The request does not fit the wire protocol (its bounds or the bus message size)."""


class StageTimeout(Exception):
    """A stage passed its deadline."""


class WorkerFailure(Exception):
    """A worker failed the request or vanished mid-request (a server fault, not bad input)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None  # of choice ``index``
    cached_tokens: int | None = None  # set on the event carrying the prefill result
    index: int = 0  # the choice (sampling.n > 1)
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked
    prompt_logprobs: TokenLogprobs | None = None  # once, when asked (echo)


class Choices:
    """The choices of one request that are still being generated. The consumer may end one
    early (a stop string matched in its text): the workers stop generating it, and the request
    is over once no choice is open."""

    def __init__(self, n: int) -> None:
        self.open = set(range(n))
        self._cancel: Callable[[int], None] | None = None

    def bind(self, cancel: Callable[[int], None]) -> None:
        self._cancel = cancel

    def stop(self, index: int) -> None:
        if index not in self.open:
            return
        self.open.discard(index)
        if self.open and self._cancel is not None:
            # the last one ends the request itself, which cancels it whole
            self._cancel(index)

    def ended(self, index: int) -> None:
        self.open.discard(index)


@dataclass
class WorkerLeft:
    """Put on a request's queue when a worker it waits on leaves the registry."""

    worker_id: str


@dataclass
class WorkerRejoined(WorkerLeft):
    """Put on a request's queue when a worker it waits on says its NATS connection broke and is
    back: what it was sent or sent meanwhile may be lost. To a prefill that is as good as a
    departure (retried elsewhere); decode legs on it are checked (``gateway/stream_check.py``)."""


@dataclass
class BusReconnected:
    """Put on every request's queue when the gateway's NATS connection is back after a break:
    whatever was published while it was down (tokens, requests, cancels) may be lost, so
    prefills are sent again elsewhere and decode legs checked (``gateway/stream_check.py``)."""

    epoch: int  # the dispatcher's bus epoch since this reconnect


@dataclass
class CheckDue:
    """A timer of a leg's stream check: ask again, or give up (``gateway/stream_check.py``)."""

    bus_id: str


Item = PrefillResult | TokenItem | WorkerLeft | BusReconnected | CheckDue


def check_ending(finish_reason: str | None, worker_id: str) -> None:
    """Only "stop" and "length" are a normal end; a worker-side abort or error without a
    message must still reach the client as an error, never as a short successful answer."""
    if finish_reason not in (None, "stop", "length"):
        raise WorkerFailure(
            f"worker {worker_id} ended the request ({finish_reason})", finish_reason
        )
