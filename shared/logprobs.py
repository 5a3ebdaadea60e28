"""Log-probabilities as they travel from the engine to the gateway: flat lists, a few per
token, so a message of many tokens stays one small msgpack map."""

from __future__ import annotations

from dataclasses import dataclass, field

# A log-prob of -inf (a token masked by a grammar, or a bias of -100 in fp32) is sent as this, as
# vLLM does: JSON has no infinity and the bus refuses non-finite floats.
MIN_LOGPROB = -9999.0


@dataclass
class TokenLogprobs:
    """Log-probs of consecutive tokens: each chosen token's own and its rank (1 = the
    likeliest), then the ``top_k`` likeliest alternatives per token, flattened, likeliest
    first."""

    top_k: int = 0
    token_logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_logprobs)
        if len(self.ranks) != n:
            raise ValueError("one rank per token")
        if len(self.top_token_ids) != n * self.top_k or len(self.top_logprobs) != n * self.top_k:
            raise ValueError(f"{self.top_k} alternatives per token")

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def extend(self, other: TokenLogprobs) -> None:
        if len(other) and len(self) and other.top_k != self.top_k:
            raise ValueError("cannot join log-probs with different top_k")
        if not len(self):
            self.top_k = other.top_k
        self.token_logprobs.extend(other.token_logprobs)
        self.ranks.extend(other.ranks)
        self.top_token_ids.extend(other.top_token_ids)
        self.top_logprobs.extend(other.top_logprobs)

    def top(self, i: int) -> list[tuple[int, float]]:
        """The i-th token's alternatives: (token id, log-prob), likeliest first."""
        span = slice(i * self.top_k, (i + 1) * self.top_k)
        return list(zip(self.top_token_ids[span], self.top_logprobs[span], strict=True))

    def slice(self, start: int, stop: int) -> TokenLogprobs:
        k = self.top_k
        return TokenLogprobs(
            k,
            self.token_logprobs[start:stop],
            self.ranks[start:stop],
            self.top_token_ids[start * k : stop * k],
            self.top_logprobs[start * k : stop * k],
        )
