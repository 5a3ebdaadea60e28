"""What a worker remembers about a request while its engine serves it, and the spans and
samples that request leaves on its way (queue time, prefill forward passes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.services.engine.outputs import StepResult
from pdserve.shared.telemetry import tracing


@dataclass
class RequestState:
    bus_id: str
    reply_to: str
    deadline: float
    context: object  # OTel context extracted from the message headers
    arrival_ns: int = field(default_factory=time.time_ns)
    first_scheduled_ns: int | None = None
    num_prompt_tokens: int = 0
    # The id spans and logs carry: the one clients and operators know (their x-request-id), or
    # the bus id where the sender named none.
    client_id: str = ""
    # Its first token went out: its deadline no longer applies here. A long answer that keeps
    # streaming must not be cut off by a wall clock; the gateway ends one that stalls, and its
    # Cancel frees what the request holds here.
    started: bool = False
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)

    def attributes(self, worker_id: str) -> dict:
        return {tracing.ATTR_REQUEST_ID: self.client_id, tracing.ATTR_WORKER_ID: worker_id}


def record_queue(state: RequestState, worker_id: str, span: str, start_ns: int) -> float | None:
    """The request's first engine step ends its queue span; returns its queue time in seconds
    (None after the first step)."""
    if state.first_scheduled_ns is not None:
        return None
    state.first_scheduled_ns = start_ns
    tracing.record_span(
        span,
        state.arrival_ns,
        start_ns,
        context=state.context,
        attributes=state.attributes(worker_id),
    )
    return (start_ns - state.arrival_ns) / 1e9


def record_prefill_forward(state: RequestState, worker_id: str, step: StepResult, **extra) -> None:
    """The ``prefill.forward`` span of one request in a step, on either kind of worker."""
    stats = step.stats
    tracing.record_span(
        tracing.SPAN_PREFILL_FORWARD,
        step.start_ns,
        step.end_ns,
        context=state.context,
        attributes={
            **state.attributes(worker_id),
            tracing.ATTR_BATCH_SIZE: stats.num_seqs,
            tracing.ATTR_BATCH_TOKENS: stats.num_tokens,
            tracing.ATTR_CACHED_TOKENS: stats.prefill_seqs.get(state.bus_id, 0),
            **tracing.roofline_attributes(stats.roofline),  # the worker set it (on_step)
            **extra,
        },
    )
