"""What a request in flight hands its consumer: token events, the choices still open (which the
consumer may stop), and what it has been handed so far (what a migration replays).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.shared.bus.request_messages import PrefillResult
from pdserve.shared.bus.stream_messages import TokenItem
from pdserve.shared.sampling import TokenLogprobs


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
            token_ids=list(self.tokens[0]),
            finish_reason=result.finish_reason,
            cached_tokens=result.cached_tokens,
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
            token_ids=list(item.token_ids),
            finish_reason=item.finish_reason,
            cached_tokens=cached,
            index=index,
            logprobs=item.logprobs,
            prompt_logprobs=prompt_logprobs,
        )
