"""What the gateway asks of workers for one request: its prefill, its decode, its cancel.

``PrefillRequest`` goes to ``{ns}.prefill.{worker}`` and is answered with a ``PrefillResult``
(the first token and a ``KVHandle``) on the gateway's inbox; ``DecodeRequest`` goes to
``{ns}.decode.{worker}``, answered by the token stream (``stream_messages.py``); ``Cancel`` is
broadcast on ``{ns}.cancel``. How a request may end (``FINISH_REASONS``, ``ERROR_CODES``) is
said here, once, for the token stream's items too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.wire_fields import (
    MAX_ADAPTER_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    bounded,
    count,
    ident,
    seconds,
    subject,
    text,
    tokens,
)
from pdserve.shared.sampling import MAX_N, SamplingParams, TokenLogprobs

FINISH_REASONS = ("stop", "length", "abort", "error")
# error_code values workers send (free text on the wire, so a newer worker may add codes):
ERROR_CODES = {
    "overloaded": "the worker's queue is full (retry elsewhere)",
    "draining": "the worker is shutting down (retry elsewhere)",
    "deadline": "the request's deadline passed in this worker before its first token",
    "invalid": "this model cannot serve the request (too long, token id out of range...)",
    "kv_transfer": "the decode worker could not pull the KV (policy fail)",
    "kv_reprefill": "the decode worker could not pull the KV (policy reprefill): prefill again",
    "internal": "a bug or an unexpected fault",
    "unknown": "answers a StreamCheck: the decode worker has no such request (over, or lost)",
}


@dataclass
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill_request"
    bus_id: str = ident()
    prompt_token_ids: list[int] = tokens()
    sampling: SamplingParams = bounded()
    reply_to: str = subject()
    deadline: float = seconds()
    # the client's x-request-id: the bus id above is the gateway's own (unique), this one names
    # the request on spans and in logs, where people look it up
    client_id: str | None = ident(default=None)
    stream_kv: bool = bounded(default=False)  # may lease early: kv/transfer/stream.py
    # the LoRA adapter the request runs under (the API's model name; None: the base model):
    # both the prefill and the decode worker apply it
    lora: str | None = text(max_len=MAX_ADAPTER_CHARS, default=None)


@dataclass
class PrefillResult:
    TYPE: ClassVar[str] = "prefill_result"
    bus_id: str = ident()
    worker_id: str = ident()
    first_token: int | None = count(hi=MAX_TOKEN_ID)
    finish_reason: str | None = text(max_len=16, choices=FINISH_REASONS)
    kv: KVHandle | None = bounded()
    error: str | None = text()
    cached_tokens: int = count(hi=MAX_TOKENS, default=0)
    # machine-readable error kind (ERROR_CODES); the gateway retries "overloaded"/"draining"
    error_code: str | None = text(max_len=32, default=None)
    first_logprobs: TokenLogprobs | None = bounded(default=None)  # of first_token (logprobs asked)
    # of the prompt's tokens after the first (prompt_logprobs asked): computed in the prefill
    prompt_logprobs: TokenLogprobs | None = bounded(default=None)

    @classmethod
    def failure(cls, bus_id: str, worker_id: str, code: str, error: str) -> PrefillResult:
        """The prefill of ``bus_id`` ended with an error (``code``: see ERROR_CODES)."""
        return cls(
            bus_id=bus_id,
            worker_id=worker_id,
            first_token=None,
            finish_reason="error",
            kv=None,
            error=error,
            cached_tokens=0,
            error_code=code,
        )


@dataclass
class DecodeRequest:
    TYPE: ClassVar[str] = "decode_request"
    bus_id: str = ident()
    prompt_token_ids: list[int] = tokens()
    output_token_ids: list[int] = tokens()  # already generated, e.g. [first_token]
    sampling: SamplingParams = bounded()
    kv: KVHandle | None = bounded()  # None: the decode worker prefills locally
    reply_to: str = subject()
    # the first token's: a worker drops the request when it passes before then (queued,
    # pulling, prefilling), never once it streams - the gateway judges stalls from there
    deadline: float = seconds()
    client_id: str | None = ident(default=None)  # as in PrefillRequest
    lora: str | None = text(max_len=MAX_ADAPTER_CHARS, default=None)  # as in PrefillRequest


@dataclass
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    bus_id: str = ident()
    # one choice of a request with sampling.n > 1 (a stop string ended it); None: all of it
    index: int | None = count(hi=MAX_N - 1, default=None)
