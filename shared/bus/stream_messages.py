"""The token stream: what a decode worker sends a gateway inbox while it generates.

One ``TokenBatch`` per engine step and inbox, an item per request (and choice) with its new
tokens and their position; ``StreamCheck`` is the gateway asking where a stream stands after a
gap or a reconnect, answered in the stream itself (``gateway/inflight/stream_check.py``,
``services/decode/decode_state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.shared.bus.request_messages import FINISH_REASONS
from pdserve.shared.bus.wire_fields import (
    MAX_BATCH_ITEMS,
    MAX_TOKENS,
    bounded,
    count,
    ident,
    subject,
    text,
    tokens,
)
from pdserve.shared.sampling import MAX_N, TokenLogprobs


@dataclass
class TokenItem:
    """New tokens of one request; with ``error`` set it is the request's last item, has no
    tokens and ``finish_reason == "error"``. No tokens and no finish_reason: it answers a
    StreamCheck (``position`` is then where the choice's next token goes)."""

    bus_id: str = ident()
    token_ids: list[int] = tokens()
    finish_reason: str | None = text(max_len=16, choices=FINISH_REASONS, default=None)
    error: str | None = text(default=None)
    error_code: str | None = text(max_len=32, default=None)  # request_messages.ERROR_CODES
    # on the first item of a request the decode worker prefilled itself: prompt tokens its
    # prefix cache served (None otherwise: a prefill worker already reported them)
    cached_tokens: int | None = count(hi=MAX_TOKENS, default=None)
    index: int = count(hi=MAX_N - 1, default=0)  # the choice (sampling.n > 1) these belong to
    logprobs: TokenLogprobs | None = bounded(default=None)  # of token_ids, when logprobs were asked
    # with the first item of a request prefilled here, when prompt_logprobs were asked
    prompt_logprobs: TokenLogprobs | None = bounded(default=None)
    # index of token_ids[0] in the choice's output (output_token_ids included): a receiver
    # sees lost items as a gap (gateway/inflight/stream_check.py)
    position: int = count(hi=MAX_TOKENS, default=0)


@dataclass
class TokenBatch:
    """Everything one engine step produced for one gateway inbox."""

    TYPE: ClassVar[str] = "token_batch"
    items: list[TokenItem] = bounded(max_len=MAX_BATCH_ITEMS)


@dataclass
class StreamCheck:
    """Where does the stream of ``bus_id`` stand? The worker sends ``reply_to`` its recent
    token batches again, then a TokenItem without tokens per choice, or an "unknown" error."""

    TYPE: ClassVar[str] = "stream_check"
    bus_id: str = ident()
    reply_to: str = subject()
