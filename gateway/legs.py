"""The decode side of one request as DecodeRequests in flight ("legs"), and how a migration
re-plans them.

A request normally has one leg: one DecodeRequest, under the request's own bus id, on one decode
worker, which generates every choice. When that worker is lost the gateway migrates the request:
it re-sends what is still open, with the tokens the client already has, so that the new worker
rebuilds the KV from prompt + delivered tokens (a local prefill, which its prefix cache helps)
and continues exactly where the stream stopped:

- greedy choices continue identically;
- seeded sampling continues exactly, because the engine's noise is a function of (seed, output
  position), not a stream of draws, and the gateway fixes the seed before the first dispatch
  when the client gave none (``with_fixed_seed``);
- penalties, ``min_tokens`` and ``max_tokens`` count the delivered tokens, which travel as the
  DecodeRequest's ``output_token_ids``; structured output replays them through its grammar;
- log-probs are per token, so the new worker's simply continue; prompt log-probs are sent once.

A request with ``n > 1`` is re-sent whole (one leg, the engine forks the choices again) only
while no choice but the first has a token yet. Otherwise each open choice becomes a leg of its
own: an ``n = 1`` request with the choice's delivered tokens and the seed the engine would have
given it (``choice_seed``); its items say index 0, which the gateway maps back to the choice.

The client's stream goes on: no token is repeated, skipped or reordered (tokens are delivered
only from the live legs, and each continues from precisely what was delivered), and each choice
ends once. At most ``--max-migrations`` times a request, and only to a live decode worker;
otherwise the stream ends with ``worker_lost``. Each migration is a log line naming both
workers, a ``pdserve.migration`` event on the request's span (``record_migration``), and one
count of ``pdserve_request_migrations_total{reason}``.

Whether a decode stream lost tokens on the bus, and how the gateway gets them back or finds
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
are gone and the leg migrates (``gateway/inflight.py``: re-sent with the delivered tokens,
from which another worker continues exactly); "unknown" while the stream is open migrates too.

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
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.gateway.inflight_types import CheckDue
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.stream_messages import TokenItem
from pdserve.shared.bus.subjects import MAX_ID_CHARS
from pdserve.shared.discovery.worker_registry import CONFIRM_TIMEOUT_FACTOR
from pdserve.shared.sampling import MAX_SEED, SamplingParams, choice_seed
from pdserve.shared.telemetry import tracing as tr

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


log = logging.getLogger("pdserve.gateway.dispatch")


BUS_ID_SUFFIX = 16  # hex digits of randomness in a request's bus id


# Most requests stop long before max_tokens (which for chat defaults to the whole context), so
# the load estimate of a leg counts only a typical output length.
TYPICAL_OUTPUT_TOKENS = 256


# How long a leg migrated away after it streamed is remembered, to cancel it again if its worker
# turns up: such a leg has no deadline on its worker, which would run it to its end.
ABANDONED_STREAM_SECONDS = 3600.0


def new_bus_id(client_id: str) -> str:
    """A request's id on the bus: the client's x-request-id (readable in worker logs) plus a
    random suffix. Clients reuse ids (retries, two tabs, two gateways behind one balancer), and
    a shared bus id would let one request's cancel or tokens reach the other. Each leg of a
    migrated request gets a fresh one, so the lost worker's late tokens never reach it."""
    keep = MAX_ID_CHARS - BUS_ID_SUFFIX - 1
    return f"{client_id[:keep]}-{secrets.token_hex(BUS_ID_SUFFIX // 2)}"


@dataclass
class Leg:
    """One DecodeRequest of a request in flight."""

    bus_id: str  # its id on the bus (the request's own for the first leg)
    index: int | None  # the choice it generates alone; None: all of them (items say which)
    output: list[int]  # tokens already delivered, sent along as output_token_ids
    sampling: SamplingParams
    kv: KVHandle | None = None  # the prefill worker's KV to pull; None: prefill locally
    worker: str = ""  # the decode worker it was sent to
    tried: set[str] = field(default_factory=set)  # decode workers that refused it
    streamed: bool = False  # that worker has sent tokens for it
    epoch: int = 0  # the dispatcher's bus epoch when it was sent (see BusReconnected)
    # while its stream is checked after a reconnect: when to give up (gateway/legs.py)
    check_until: float | None = None
    # when its worker's next sign of life is due: its first token within --first-token-timeout
    # of being sent, then each item within --stall-timeout of the last (inf: no limit)
    due: float = math.inf

    def choice(self, item_index: int) -> int:
        """The request's choice an item of this leg belongs to."""
        return item_index if self.index is None else self.index

    def carries(self, open_choices: set[int]) -> set[int]:
        """The open choices it generates."""
        return open_choices if self.index is None else {self.index} & open_choices

    def abandoned_until(self, cap: float) -> float:
        """How long its worker might still run it once it is migrated away (``cap``: the
        request's): until its deadline before its first token, for a while once streaming."""
        return time.time() + ABANDONED_STREAM_SECONDS if self.streamed else min(cap, self.due)

    def expected_tokens(self, prompt_len: int) -> int:
        """The tokens it is expected to hold on its worker (the router's load estimate)."""
        remaining = max(0, self.sampling.max_tokens - len(self.output))
        return prompt_len + len(self.output) + min(remaining, TYPICAL_OUTPUT_TOKENS)

    def request(
        self, prompt: list[int], reply_to: str, deadline: float, client_id: str
    ) -> DecodeRequest:
        """The DecodeRequest that sends it (``deadline``: its first token's, on the wire)."""
        return DecodeRequest(
            self.bus_id, prompt, self.output, self.sampling, self.kv, reply_to, deadline, client_id
        )


def with_fixed_seed(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with a seed: the client's, or a random one drawn here. Without it the
    worker would draw one of its own, and a migrated request would continue with different
    randomness; with it, a replay from the delivered tokens continues exactly."""
    if sampling.seed is not None or sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=secrets.randbelow(MAX_SEED + 1))


def replan(
    open_choices: set[int],
    delivered: dict[int, list[int]],
    sampling: SamplingParams,
    prompt_logprobs_sent: bool,
) -> list[tuple[int | None, list[int], SamplingParams]]:
    """The legs that carry ``open_choices`` on from ``delivered``: ``(index, output, sampling)``
    per leg (index None: one leg for the whole request, see the module docstring)."""
    whole = sampling.n == 1 or (
        open_choices == set(range(sampling.n))
        and not any(delivered.get(i) for i in range(1, sampling.n))
    )
    # Prompt log-probs go out once, with choice 0's first token: still due only when neither
    # happened (the engine computes them only for a sequence without output tokens anyway).
    due = not prompt_logprobs_sent and not delivered.get(0)
    if whole:
        if not due and sampling.prompt_logprobs is not None:
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        return [(None, list(delivered.get(0, [])), sampling)]
    legs: list[tuple[int | None, list[int], SamplingParams]] = []
    for i in sorted(open_choices):
        one = dataclasses.replace(
            sampling,
            n=1,
            seed=None if sampling.seed is None else choice_seed(sampling.seed, i),
            prompt_logprobs=sampling.prompt_logprobs if i == 0 and due else None,
        )
        legs.append((i, list(delivered.get(i, [])), one))
    return legs


def record_migration(
    client_id: str,
    bus_id: str,
    reason: str,
    old: list[str],
    new: list[Leg],
    count: int,
    limit: int,
    context: Context | None,
) -> None:
    """Report a migration from the decode workers ``old`` to the legs ``new`` (the request's
    ``count``-th of at most ``limit``): a log line naming both sides and an event on the
    request's span (the metric is the dispatcher's)."""
    to = sorted({leg.worker for leg in new})
    tokens = sum(len(leg.output) for leg in new)
    log.warning(
        "migrated %s (%s) from decode worker %s to %s with %d delivered token(s) (%s; "
        "migration %d of at most %d)",
        client_id,
        bus_id,
        ",".join(old),
        ",".join(to),
        tokens,
        reason,
        count,
        limit,
    )
    trace.get_current_span(context).add_event(
        tr.EVENT_MIGRATION,
        {
            tr.ATTR_MIGRATION_REASON: reason,
            tr.ATTR_MIGRATION_FROM: old,
            tr.ATTR_MIGRATION_TO: to,
            tr.ATTR_MIGRATION_TOKENS: tokens,
            tr.ATTR_MIGRATION_COUNT: count,
        },
    )
