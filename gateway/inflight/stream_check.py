"""Whether a decode stream lost tokens on the bus, and how the gateway gets them back or finds
out: a NATS blip migrates only the streams whose tokens are really gone.

NATS core loses messages only across a broken connection: what was published to the gateway
while its own connection was down (or before its subscriptions were back), and what a worker
wrote into its dead connection before it noticed. Every ``TokenItem`` carries the position of
its first token in its choice's output, so each item is held against what the client already
has (``offset``): the next one is delivered, one the client has is dropped (a worker sends its
recent token batches again after a reconnect: ``shared/bus/replay.py``), and one further on
shows a gap.

A gap is not a migration yet: the leg is *checked*. Its worker is asked (``StreamCheck``); it
sends this gateway again what it sent it lately, then answers in the stream itself, behind
every item before it, with the position of each choice - or "unknown" once the request is over
there (or never arrived). Items past a gap are dropped meanwhile (the replay brings them again).
The answer is exact: at the delivered positions the stream simply goes on; further on, tokens
are gone and the leg migrates (``bus_request.py``: re-sent with the delivered tokens, from which
another worker continues exactly); "unknown" while the stream is open migrates too.

A stream whose last items (its finish among them) were lost shows no gap: nothing follows. So
after a reconnect - ours (``BusReconnected``: every leg sent before it) or a worker's
(``WorkerRejoined``: its legs) - each leg is checked as well. A silence timeout could not tell
a lost tail from a stream that is only slow (queued, preempted, prefilling a long prompt), and
would move those too. A check sent before the worker's subscriptions are back is lost, so it is
sent again every ``CHECK_RETRY_SECONDS``; unanswered after ``CHECK_TIMEOUTS`` registry timeouts
- by then a live worker has long been heard (silence counts from our reconnect) and a dead one
has left the registry, its streams migrating as ``worker_lost`` - the leg migrates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping

from pdserve.gateway.inflight.legs import Leg
from pdserve.gateway.inflight.queue_items import CheckDue
from pdserve.shared.bus.stream_messages import TokenItem
from pdserve.shared.discovery.worker_registry import CONFIRM_TIMEOUT_FACTOR

CHECK_RETRY_SECONDS = 0.5


# a worker silent for one registry timeout after our reconnect is pinged, and gone when the
# ping goes unanswered for CONFIRM_TIMEOUT_FACTOR more
CHECK_TIMEOUTS = 1.0 + CONFIRM_TIMEOUT_FACTOR


UNKNOWN = "unknown"  # the error code of a worker's answer: it has no such request


SKIP = "skip"  # what ``screen`` says of an item the client must not get


GAP = "gap"  # ... of one past a gap: dropped too, and its leg checked (unless it is already)


def is_answer(item: TokenItem) -> bool:
    """Whether ``item`` answers a StreamCheck (a worker's items with no tokens always end their
    choice or carry an error)."""
    return not item.token_ids and item.finish_reason is None and item.error is None


def offset(
    index: int, item: TokenItem, open_choices: set[int], delivered: Mapping[int, list[int]]
) -> int:
    """Where ``item`` (of choice ``index``) starts against what was delivered of its choice:
    0 continues it, below 0 repeats what the client has (a replay), above 0 leaves a gap. A
    choice the consumer ended is held to nothing (0)."""
    if index not in open_choices:
        return 0
    return item.position - len(delivered.get(index, ()))


def screen(
    leg: Leg, item: TokenItem, open_choices: set[int], delivered: Mapping[int, list[int]]
) -> str | None:
    """What becomes of ``item`` of ``leg``: None, delivered (the decode stage handles it);
    ``SKIP``, dropped; ``GAP``, dropped and the leg to be checked (its worker sends again what
    it sent lately); otherwise why the stream's tokens are gone (migrate it). An answer at the
    delivered positions ends the leg's check."""
    if item.error is not None:
        return "its worker no longer has it" if item.error_code == UNKNOWN else None
    index = leg.choice(item.index)
    ahead = offset(index, item, open_choices, delivered)
    if is_answer(item):
        if ahead > 0:
            return f"choice {index} is {ahead} token(s) past what arrived"
        if ahead == 0:
            leg.check_until = None
        return SKIP  # (below 0: an earlier answer, overtaken by a replay)
    if ahead < 0:
        # a replay of what the client has; one reaching past it would be a worker bug
        return SKIP if ahead + len(item.token_ids) <= 0 else "items overlap"
    if ahead > 0:
        return GAP if leg.check_until is None else SKIP  # (checked already)
    return None


def check(
    legs: Iterable[Leg],
    ask: Callable[[str, str], None],
    put: Callable[[CheckDue], None],
    worker_timeout: float,
) -> None:
    """Ask the workers of ``legs`` where their streams stand (``ask(worker, bus_id)``), and have
    ``put`` get each leg's ``CheckDue`` in ``CHECK_RETRY_SECONDS`` (``check_due``). A leg's
    check gives up ``CHECK_TIMEOUTS`` registry timeouts (``worker_timeout``) after the last."""
    until = time.time() + CHECK_TIMEOUTS * worker_timeout
    for leg in legs:
        if leg.check_until is None:  # else its timer runs already
            _again_later(put, leg.bus_id)
        leg.check_until = until
        ask(leg.worker, leg.bus_id)


def check_due(leg: Leg, ask: Callable[[str, str], None], put: Callable[[CheckDue], None]) -> bool:
    """At a ``CheckDue`` of ``leg``: whether its check went unanswered for too long (migrate
    it); else it is asked again if still unanswered."""
    if leg.check_until is None:
        return False  # answered
    if time.time() >= leg.check_until:
        return True
    # a check sent before the worker's subscriptions were back is lost
    ask(leg.worker, leg.bus_id)
    _again_later(put, leg.bus_id)
    return False


def _again_later(put: Callable[[CheckDue], None], bus_id: str) -> None:
    asyncio.get_running_loop().call_later(CHECK_RETRY_SECONDS, put, CheckDue(bus_id))
