"""Verify a new model version's workers before any client request reaches them (``pdserve
rollout``, services/control/rollout.py).

The workers are on standby, so the gateway will not route to them: the probe speaks the
gateway's side of the worker protocol itself, over NATS, through the real path - a prefill on a
new prefill worker, the KV pulled over UCX by a new decode worker, greedy tokens back. It checks
the answer for what can be known of a checkpoint nobody has seen: every pair of new workers
(each new worker in at least one) answers the fixed prompt with all ``max_tokens`` tokens,
no error, and the same tokens as every other pair and as a second run on the first pair (greedy
decoding of one model is deterministic: a worker that loaded other weights, a broken KV path or
a garbled pull disagrees). A given ``expect`` (token ids) must be the answer's beginning.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.request_messages import DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import TokenBatch
from pdserve.shared.config import BusConfig
from pdserve.shared.sampling import SamplingParams

PROMPT = list(range(1, 17))  # token ids every vocabulary has
MAX_TOKENS = 8


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # what failed, or the answer's tokens
    tokens: tuple[int, ...] = ()


class _Inbox:
    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}

    def queue(self, bus_id: str) -> asyncio.Queue:
        return self.queues.setdefault(bus_id, asyncio.Queue())

    async def on_message(self, msg: PrefillResult | TokenBatch, headers: dict[str, str]) -> None:
        if isinstance(msg, PrefillResult):
            self.queue(msg.bus_id).put_nowait(msg)
            return
        for item in msg.items:
            self.queue(item.bus_id).put_nowait(item)


async def _one(
    bus: Bus, inbox: _Inbox, reply_to: str, prefill: str, decode: str, timeout: float
) -> list[int]:
    """Prompt -> ``prefill`` -> KV -> ``decode`` -> tokens; raises with what went wrong."""
    bus_id = f"rollout-probe-{secrets.token_hex(6)}"
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    deadline = time.time() + timeout
    req = PrefillRequest(
        bus_id=bus_id,
        prompt_token_ids=PROMPT,
        sampling=sampling,
        reply_to=reply_to,
        deadline=deadline,
    )
    await bus.publish(bus.subjects.prefill(prefill), req)
    queue = inbox.queue(bus_id)
    result = await asyncio.wait_for(queue.get(), timeout)
    if not isinstance(result, PrefillResult) or result.error or result.first_token is None:
        raise RuntimeError(f"{prefill}: prefill failed: {getattr(result, 'error', result)}")
    first = result.first_token
    await bus.publish(
        bus.subjects.decode(decode),
        DecodeRequest(
            bus_id=bus_id,
            prompt_token_ids=PROMPT,
            output_token_ids=[first],
            sampling=sampling,
            kv=result.kv,
            reply_to=reply_to,
            deadline=deadline,
        ),
    )
    tokens = [first]
    while True:
        item = await asyncio.wait_for(queue.get(), max(0.1, deadline - time.time()))
        if item.error:
            raise RuntimeError(f"{prefill} -> {decode}: {item.error}")
        tokens.extend(item.token_ids)
        if item.finish_reason is not None:
            return tokens


async def verify(
    bus_config: BusConfig,
    prefill: list[str],
    decode: list[str],
    timeout: float = 60.0,
    expect: list[int] | None = None,
) -> ProbeResult:
    """Probe every new worker (pairs until each was in one, then the first pair again)."""
    bus = Bus(bus_config, f"rollout-probe-{secrets.token_hex(4)}")
    inbox = _Inbox()
    reply_to = bus.subjects.gateway(f"rollout-{secrets.token_hex(4)}")
    pairs = [
        (prefill[i % len(prefill)], decode[i % len(decode)])
        for i in range(max(len(prefill), len(decode)))
    ]
    pairs.append(pairs[0])  # determinism: the first pair again
    try:
        await bus.connect(timeout=10.0)
        await bus.subscribe(reply_to, inbox.on_message, (PrefillResult, TokenBatch))
        answers = []
        for p, d in pairs:
            try:
                answers.append(await _one(bus, inbox, reply_to, p, d, timeout))
            except (RuntimeError, asyncio.TimeoutError) as exc:
                return ProbeResult(False, f"probe {p} -> {d}: {exc or 'no answer in time'}")
        first = answers[0]
        if len(first) != MAX_TOKENS:
            return ProbeResult(False, f"{len(first)} tokens, not {MAX_TOKENS}: {first}")
        for (p, d), got in zip(pairs, answers, strict=True):
            if got != first:
                return ProbeResult(False, f"{p} -> {d} answered {got}, {pairs[0]} {first}")
        if expect and first[: len(expect)] != list(expect):
            return ProbeResult(False, f"answer {first} does not start with {list(expect)}")
        return ProbeResult(True, f"{len(pairs)} probes answered {first}", tuple(first))
    finally:
        await bus.close()
