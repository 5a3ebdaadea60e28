"""Per-request sampling parameters and their bounds: one definition that the gateway's request
validation, the wire protocol's checker and the engine's sampler all use.

And log-probabilities as they travel from the engine to the gateway: flat lists, a few per
token, so a message of many tokens stays one small msgpack map.
"""

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
            top_k=k,
            token_logprobs=self.token_logprobs[start:stop],
            ranks=self.ranks[start:stop],
            top_token_ids=self.top_token_ids[start * k : stop * k],
            top_logprobs=self.top_logprobs[start * k : stop * k],
        )


MAX_TEMPERATURE = 2.0


MAX_TOP_K = 2**31 - 1  # any token id: the wire protocol's bound


MAX_SEED = 2**63 - 1


MAX_MAX_TOKENS = 1 << 20  # the wire protocol's token-list bound


MAX_STOP_TOKEN_IDS = 1024


MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows


MAX_N = 16  # sequences forked from one prompt (the API's n, or best_of)


MAX_LOGIT_BIAS = 1024  # entries


MAX_LOGIT_BIAS_VALUE = 100.0


MAX_REPETITION_PENALTY = 10.0


MAX_GUIDED_SPEC_CHARS = 64 * 1024


MAX_PRIORITY = 2**31 - 1  # vLLM's priority is any int; an int32's range is plenty


MAX_CACHE_SALT_CHARS = 256  # the gateway sends a 32-hex-digit digest (gateway/tenancy.py)


GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Where a reasoning model's answer starts (``GuidedDecoding.reasoning``): "" none, "inside" its
# <think> section, "tag" only if it opens with <think>. The tags of the <think> family
# (``--reasoning-parser``: deepseek_r1, qwen3).
REASONING_STARTS = ("", "inside", "tag")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Bound:
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is not allowed

    def admits(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and value <= self.hi


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, MAX_TEMPERATURE),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, MAX_TOP_K),  # -1 is off; 0 is refused here (the API maps 0 to -1)
    "seed": Bound(-MAX_SEED, MAX_SEED),
    # 0 generates nothing: only the prompt's log-probs (echo) come back
    "max_tokens": Bound(0, MAX_MAX_TOKENS),
    "min_tokens": Bound(0, MAX_MAX_TOKENS),
    "n": Bound(1, MAX_N),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, MAX_REPETITION_PENALTY, lo_open=True),
    "priority": Bound(-MAX_PRIORITY, MAX_PRIORITY),
}


@dataclass(frozen=True)
class GuidedDecoding:
    """Structured output: every sampled token must keep the output inside this language.

    ``kind`` is one of ``GUIDED_KINDS``; ``spec`` is the JSON schema (``json_schema``), the
    regular expression (``regex``), a JSON array of the allowed strings (``choice``), a
    context-free grammar in Lark or GBNF syntax (``grammar``), or empty (``json_object``: any
    JSON object).

    ``reasoning`` (one of ``REASONING_STARTS``) puts the grammar after a reasoning model's
    thoughts: free text up to ``</think>`` ("inside"), or an optional ``<think>...</think>``
    section ("tag"). Otherwise the grammar would hold from the first token and forbid the
    thinking the model was trained to do first."""

    kind: str
    spec: str = ""
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided kind must be one of {GUIDED_KINDS}, got {self.kind!r}")
        if self.reasoning not in REASONING_STARTS:
            raise ValueError(f"guided reasoning must be one of {REASONING_STARTS}")
        if len(self.spec) > MAX_GUIDED_SPEC_CHARS:
            raise ValueError(f"guided spec longer than {MAX_GUIDED_SPEC_CHARS} chars")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Choices forked from one prefill (the API's best_of when it is larger than n). Choice i
    # samples with its own seed, derived from (seed, i); choice 0 uses ``seed`` itself.
    n: int = 1
    # Log-probs of each generated token plus this many top alternatives (None: none).
    logprobs: int | None = None
    # The same for each prompt token after the first (echo); computed during prefill.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token has appeared
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count so far
    repetition_penalty: float = 1.0  # vLLM's/HF's: prompt and output tokens' logits / (or *) it
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    # OpenAI's logit_bias as two parallel lists (msgpack maps only take string keys).
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    guided: GuidedDecoding | None = None
    # Speculative decoding where the decode worker runs it (--speculative): False opts this
    # request out. It changes speed only: greedy and seeded outputs are the same either way.
    speculate: bool = True
    # vLLM's: lower is served first under --scheduling-policy priority (always 0 under fcfs).
    # Not sampling, but it travels where sampling does: prefill, decode and migrated legs.
    priority: int = 0
    # The prefix-cache salt: it names the root of the request's chain of block hashes
    # (shared/kv/layout.py), so requests with different salts never share a cached block.
    # None: the unsalted chain. The gateway combines the client's cache_salt and its API key.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not bound.admits(value):
                raise ValueError(f"{name} must be in {_describe(bound)}, got {value}")
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if len(self.logit_bias_token_ids) != len(self.logit_bias_values):
            raise ValueError("logit_bias token ids and values differ in length")
        if len(self.logit_bias_token_ids) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        if any(abs(v) > MAX_LOGIT_BIAS_VALUE for v in self.logit_bias_values):
            raise ValueError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                f"{MAX_LOGIT_BIAS_VALUE:g}]"
            )
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logit_bias(self) -> dict[int, float]:
        return dict(zip(self.logit_bias_token_ids, self.logit_bias_values, strict=True))

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice ``index``: the request's own for choice 0, else a splitmix64
    mix of (seed, index), kept to 63 bits (a valid ``SamplingParams.seed`` and an int64).

    The engine seeds each forked choice with it, and the gateway seeds a choice it re-sends on
    its own after a migration with it, so both sample the same tokens."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _describe(bound: Bound) -> str:
    return f"{'(' if bound.lo_open else '['}{bound.lo:g}, {bound.hi:g}]"
