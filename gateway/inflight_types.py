"""What flows through a request in flight (``gateway/inflight.py``): the limits it runs under, the
faults it may end with, the events it yields to its consumer, the choices still open and what
the consumer has been handed, and the items its queue receives.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from pdserve.shared.bus.request_messages import PrefillResult
from pdserve.shared.bus.stream_messages import TokenItem
from pdserve.shared.sampling import TokenLogprobs

PREFILL_ATTEMPTS = 3  # prefill is idempotent: a dead or overloaded worker's request goes elsewhere
DECODE_ATTEMPTS = 3  # a decode worker that refuses a request before its first token
RETRYABLE_CODES = ("overloaded", "draining")
DEFAULT_MAX_MIGRATIONS = 3  # a request's re-dispatches after losing its decode worker
# why a request was migrated (the reason label of pdserve_request_migrations_total)
MIGRATE_WORKER_LOST = "worker_lost"  # its decode worker left the registry (gone, or dead)
# tokens of its stream were lost on the bus: a gap in their positions, or a check after a NATS
# reconnect found the stream over or unknown on its worker, or unanswered (gateway/legs.py)
MIGRATE_BUS_RECONNECT = "bus_reconnect"
MIGRATE_WHY = {  # what the error says when a stream cannot migrate
    MIGRATE_WORKER_LOST: "stopped while serving the request",
    MIGRATE_BUS_RECONNECT: "sent tokens that the bus lost",
}
# The latest deadline a message carries when no limit applies: the wire's bound is 1e12 (a
# deadline is a Unix time) and infinity is not JSON; this is the year 5138.
WIRE_NO_DEADLINE = 1e11


@dataclass(frozen=True)
class Limits:
    """What one request runs under, as the dispatcher's options say when it arrives (seconds,
    0 = no limit; see ``gateway/inflight.py``)."""

    request_timeout: float  # a total cap, only where the operator sets one
    prefill_timeout: float  # per prefill attempt
    first_token_timeout: float  # of the request, and of each leg on a new decode worker
    stall_timeout: float  # between two tokens
    max_migrations: int  # re-dispatches after losing a decode worker
    worker_timeout: float  # the registry's: a stream check waits CHECK_TIMEOUTS of these

    def overdue(self, limit: str, stage: str) -> str:
        """Why a wait timed out: ``limit`` ("request", "prefill", "stall" or "first_token")
        passed, during ``stage``; the message names the option."""
        seconds = getattr(self, f"{limit}_timeout")
        why = {
            "request": f"the request took longer than --request-timeout ({seconds:g} s)",
            "prefill": f"the stage passed its --prefill-timeout ({seconds:g} s)",
            "stall": f"no new token for --stall-timeout ({seconds:g} s)",
            "first_token": f"no first token within --first-token-timeout ({seconds:g} s)",
        }[limit]
        return f"{why} in the {stage} stage"


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


class OpenChoices:
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


class Delivered:
    """What the consumer of one request has been handed: each choice's tokens (what a migration
    replays) and the facts a request reports once.

    The workers report facts: a prefill worker the prompt's prefix-cache hits and prompt
    log-probs with the first token, a decode worker the same with the first item of each
    prefill it does itself. A request may be prefilled again - a leg re-sent after a refusal,
    a migration's prefill of prompt + delivered tokens - and only the gateway knows which
    prefill was the request's own: so the first answer's count of cached tokens reaches the
    client, and the first prompt log-probs, and none after them."""

    def __init__(self, choices: OpenChoices) -> None:
        self.choices = choices
        self.tokens: dict[int, list[int]] = defaultdict(list)  # by choice
        self.cached_reported = False
        self.prompt_logprobs_sent = False

    def has_tokens(self) -> bool:
        return any(self.tokens.values())

    def first_token(self, result: PrefillResult) -> TokenEvent:
        """Choice 0's first token (a prefill worker never forks: the decode worker does)."""
        if result.first_token is not None:
            self.tokens[0].append(result.first_token)
        if result.finish_reason is not None:
            self.choices.ended(0)  # done at the first token (max_tokens=1, EOS, ...)
        self.cached_reported = True
        self.prompt_logprobs_sent = result.prompt_logprobs is not None
        return TokenEvent(
            list(self.tokens[0]),
            result.finish_reason,
            result.cached_tokens,
            logprobs=result.first_logprobs,
            prompt_logprobs=result.prompt_logprobs,
        )

    def item(self, index: int, item: TokenItem) -> TokenEvent | None:
        """Choice ``index``'s next tokens from a decode worker; None when the consumer stopped
        that choice (what was under way is dropped)."""
        if index not in self.choices.open:
            return None
        self.tokens[index].extend(item.token_ids)
        if item.finish_reason is not None:
            self.choices.ended(index)
        cached = None if self.cached_reported else item.cached_tokens
        self.cached_reported = True
        prompt_logprobs = None if self.prompt_logprobs_sent else item.prompt_logprobs
        self.prompt_logprobs_sent |= prompt_logprobs is not None
        return TokenEvent(
            list(item.token_ids), item.finish_reason, cached, index, item.logprobs, prompt_logprobs
        )


@dataclass
class WorkerLeft:
    """Put on a request's queue when a worker it waits on leaves the registry."""

    worker_id: str


@dataclass
class WorkerRejoined(WorkerLeft):
    """Put on a request's queue when a worker it waits on says its NATS connection broke and is
    back: what it was sent or sent meanwhile may be lost. To a prefill that is as good as a
    departure (retried elsewhere); decode legs on it are checked (``gateway/legs.py``)."""


@dataclass
class BusReconnected:
    """Put on every request's queue when the gateway's NATS connection is back after a break:
    whatever was published while it was down (tokens, requests, cancels) may be lost, so
    prefills are sent again elsewhere and decode legs checked (``gateway/legs.py``)."""

    epoch: int  # the dispatcher's bus epoch since this reconnect


@dataclass
class CheckDue:
    """A timer of a leg's stream check: ask again, or give up (``gateway/legs.py``)."""

    bus_id: str


Item: TypeAlias = PrefillResult | TokenItem | WorkerLeft | BusReconnected | CheckDue


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


def check_ending(finish_reason: str | None, worker_id: str) -> None:
    """Only "stop" and "length" are a normal end; a worker-side abort or error without a
    message must still reach the client as an error, never as a short successful answer."""
    if finish_reason not in (None, "stop", "length"):
        raise WorkerFailure(
            f"worker {worker_id} ended the request ({finish_reason})", finish_reason
        )
