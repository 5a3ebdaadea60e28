"""A request's state on a decode worker: what its stream has sent, where that stream stands
when a gateway asks, and its ``decode.generate`` span.

Positions: every ``TokenItem`` says where its first token sits in its choice's output (the
request's ``output_token_ids`` included; a forked choice starts empty), so a gateway sees lost
items as a gap and drops those it has already. That makes token batches replayable
(``shared/bus/replay.py``): held while the bus is down, sent again after a reconnect, and to a
gateway that asks. A ``StreamCheck`` is that question: the worker replays what it sent that
gateway lately, then answers in the stream itself, behind every item sent before: an empty item
per choice at the position of its next token, or the error "unknown" for a request that is over
here or never arrived (the gateway's side: ``gateway/inflight/stream_check.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.services.request_state import RequestState
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.stream_messages import StreamCheck, TokenItem
from pdserve.shared.telemetry import tracing
from pdserve.shared.telemetry.roofline import Roofline

# decode.generate's speculative-decoding attributes (when the request's tokens were drafted)
ATTR_SPEC_DRAFT_TOKENS = "pdserve.spec.draft_tokens"  # draft tokens verified for the request
ATTR_SPEC_ACCEPTED_TOKENS = "pdserve.spec.accepted_tokens"  # ... and accepted
ATTR_SPEC_ACCEPTANCE_RATE = "pdserve.spec.acceptance_rate"  # accepted / draft tokens


@dataclass
class DecodeState(RequestState):
    num_output_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding, over all its choices
    num_accepted_tokens: int = 0
    first_step_ns: int | None = None  # first decode step (start of decode.generate)
    # the worker's decode totals (flops, bytes, seconds) before that step: decode.generate's
    # roofline is their growth until the request ends (RooflineMetrics.since)
    roofline_mark: tuple[float, float, float] | None = None
    # The prefill worker's KV the request came with (None: prefilled here). Whether it waits
    # for its pull is the engine's status (WAITING_FOR_REMOTE_KV, announced by a KVPull); the
    # worker keeps only what it does about it: the pull it runs, which releases the lease.
    # Before that pull starts, ending the request releases it.
    kv: KVHandle | None = None
    pull: asyncio.Task | None = None
    # choice -> position of its next token: what went out so far, output_token_ids included
    positions: dict[int, int] = field(default_factory=dict)

    @property
    def local_prefill(self) -> bool:
        """Prefilled here: its first item reports the prefix-cache hits of that prefill."""
        return self.kv is None

    def advance(self, index: int, num_tokens: int) -> int:
        """The position of choice ``index``'s next ``num_tokens`` tokens, which then go out."""
        position = self.positions.get(index, 0)
        self.positions[index] = position + num_tokens
        return position


def check_answer(check: StreamCheck, state: DecodeState | None, worker_id: str) -> list[TokenItem]:
    """The items that answer ``check``, ``state`` being its request's here (None: none)."""
    rid = check.bus_id
    if state is None:
        return [
            TokenItem(
                bus_id=rid,
                token_ids=[],
                finish_reason="error",
                error=f"decode worker {worker_id} has no {rid}",
                error_code="unknown",
            )
        ]
    return [
        TokenItem(bus_id=rid, token_ids=[], index=i, position=p)
        for i, p in sorted(state.positions.items())
    ]


def record_generate(
    state: DecodeState, worker_id: str, reason: str, end_ns: int, roofline: Roofline | None = None
) -> None:
    """The request's ``decode.generate`` span, from its first decode step to ``end_ns``, with
    ``roofline``: the worker's decode steps over that time (every request in them, not only
    this one's share: they ran as one batch)."""
    start = state.first_step_ns or end_ns
    n = state.num_output_tokens
    tpot_ms = (end_ns - start) / 1e6 / max(1, n - 1) if n > 1 else 0.0
    attributes = {
        **state.attributes(worker_id),
        tracing.GEN_AI_USAGE_OUTPUT_TOKENS: n,
        tracing.ATTR_TPOT_MS: tpot_ms,
        tracing.GEN_AI_RESPONSE_FINISH_REASONS: [reason],
        **tracing.roofline_attributes(roofline),
    }
    if state.num_draft_tokens:
        attributes[ATTR_SPEC_DRAFT_TOKENS] = state.num_draft_tokens
        attributes[ATTR_SPEC_ACCEPTED_TOKENS] = state.num_accepted_tokens
        attributes[ATTR_SPEC_ACCEPTANCE_RATE] = state.num_accepted_tokens / state.num_draft_tokens
    tracing.record_span(
        tracing.SPAN_DECODE_GENERATE, start, end_ns, context=state.context, attributes=attributes
    )
