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

A leg whose worker lives on but whose tokens the bus lost migrates too (reason
``bus_reconnect``): how that is found out is ``stream_check.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.subjects import MAX_ID_CHARS
from pdserve.shared.sampling import MAX_SEED, SamplingParams, choice_seed
from pdserve.shared.telemetry import tracing as tr

log = logging.getLogger(__name__)

# why a request was migrated (the reason label of pdserve_request_migrations_total)
MIGRATE_WORKER_LOST = "worker_lost"  # its decode worker left the registry (gone, or dead)
# tokens of its stream were lost on the bus: a gap in their positions, or a check after a NATS
# reconnect found the stream over or unknown on its worker, or unanswered (stream_check.py)
MIGRATE_BUS_RECONNECT = "bus_reconnect"
MIGRATE_WHY = {  # what the error says when a stream cannot migrate
    MIGRATE_WORKER_LOST: "stopped while serving the request",
    MIGRATE_BUS_RECONNECT: "sent tokens that the bus lost",
}


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
    # while its stream is checked after a reconnect: when to give up (stream_check.py)
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
        self,
        prompt: list[int],
        reply_to: str,
        deadline: float,
        client_id: str,
        lora: str | None = None,
    ) -> DecodeRequest:
        """The DecodeRequest that sends it (``deadline``: its first token's, on the wire)."""
        return DecodeRequest(
            bus_id=self.bus_id,
            prompt_token_ids=prompt,
            output_token_ids=self.output,
            sampling=self.sampling,
            kv=self.kv,
            reply_to=reply_to,
            deadline=deadline,
            client_id=client_id,
            lora=lora,
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
