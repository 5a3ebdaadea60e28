"""Synthetic benchmark workloads made of token-id prompts.

Every prompt is a list of token ids, not text, so its length on the server is exactly the
length we asked for (text would be re-tokenized to a different length). Lengths are drawn
from a seeded numpy generator, so a workload is reproducible across runs and machines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # max_tokens; with ignore_eos the server generates exactly this many

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class TokenSpace:
    """Token ids a prompt may use: [low, high) minus the tokenizer's special tokens.

    Special tokens (BOS/EOS/chat markers) are left out because a stray EOS or turn marker in a
    prompt changes what a real model does with it, and some servers reject them.
    """

    low: int
    high: int
    excluded: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"empty token id range [{self.low}, {self.high})")
        inside = {t for t in self.excluded if self.low <= t < self.high}
        if len(inside) == self.high - self.low:  # sample() would redraw forever
            raise ValueError(f"every id in [{self.low}, {self.high}) is excluded")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        ids = rng.integers(self.low, self.high, size=n)
        if self.excluded:
            bad = np.isin(ids, np.fromiter(self.excluded, dtype=np.int64))
            while bad.any():  # redraw the few special ids; terminates since the range is wider
                ids[bad] = rng.integers(self.low, self.high, size=int(bad.sum()))
                bad = np.isin(ids, np.fromiter(self.excluded, dtype=np.int64))
        return ids.tolist()


def token_space_from_tokenizer(model_dir: str | Path) -> TokenSpace:
    """Read vocab size and special ids from a Hugging Face tokenizer.json (no transformers)."""
    from tokenizers import Tokenizer

    path = Path(model_dir)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    spec = json.loads(tok.to_str())
    special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
    return TokenSpace(0, vocab, frozenset(special))


def _uniform_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """Integers uniform in [mean*(1-r), mean*(1+r)], the `vllm bench serve` random dataset rule."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range ratio must be in [0, 1)")
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_dataset(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    tokens: TokenSpace,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    """Random prompts with input/output lengths uniform around the given means."""
    in_lens = _uniform_lengths(rng, n, input_len, range_ratio)
    out_lens = _uniform_lengths(rng, n, output_len, range_ratio)
    return [
        BenchRequest(tokens.sample(rng, int(i)), int(o))
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def _lognormal_lengths(
    rng: np.random.Generator, n: int, median: int, sigma: float, max_len: int
) -> np.ndarray:
    # log-normal: its median is exp(mu), so mu = log(median); the long right tail is what
    # real chat traffic looks like (most turns short, a few pasted documents).
    lens = np.rint(rng.lognormal(mean=np.log(median), sigma=sigma, size=n)).astype(np.int64)
    return np.clip(lens, 1, max_len)


def chat_dataset(
    n: int,
    input_median: int,
    output_median: int,
    tokens: TokenSpace,
    rng: np.random.Generator,
    input_sigma: float = 1.0,
    output_sigma: float = 0.7,
    max_input_len: int = 4096,
    max_output_len: int = 1024,
) -> list[BenchRequest]:
    """Chat-like lengths: log-normal input and output lengths with heavy right tails.

    The default shape (input sigma 1.0, output sigma 0.7) gives roughly the spread seen in
    ShareGPT-style conversation logs that DistServe and vLLM benchmark against, without
    needing the data set itself.
    """
    in_lens = _lognormal_lengths(rng, n, input_median, input_sigma, max_input_len)
    out_lens = _lognormal_lengths(rng, n, output_median, output_sigma, max_output_len)
    return [
        BenchRequest(tokens.sample(rng, int(i)), int(o))
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_dataset(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    tokens: TokenSpace,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    """Requests in groups that share one long system prompt, each with its own question.

    Request i uses prefix i % num_prefixes, so groups interleave in arrival order the way
    many users of a few assistants do; a prefix cache should turn the shared part into hits.
    """
    if num_prefixes < 1:
        raise ValueError("need at least one prefix")
    prefixes = [tokens.sample(rng, prefix_len) for _ in range(num_prefixes)]
    suffix_lens = _uniform_lengths(rng, n, suffix_len, range_ratio)
    out_lens = _uniform_lengths(rng, n, output_len, range_ratio)
    return [
        BenchRequest(prefixes[i % num_prefixes] + tokens.sample(rng, int(s)), int(o))
        for i, (s, o) in enumerate(zip(suffix_lens, out_lens, strict=True))
    ]


def with_long_prompts(
    requests: list[BenchRequest],
    fraction: float,
    long_range: tuple[int, int],
    tokens: TokenSpace,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    """Replace the prompts of a random `fraction` of requests with long ones in [lo, hi].

    This is the mixed workload where long prompts' prefills interfere with everyone else's
    decode steps, the case disaggregation is built for. Output lengths are kept.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("long-prompt fraction must be in [0, 1]")
    lo, hi = long_range
    if not 1 <= lo <= hi:
        raise ValueError(f"bad long prompt range {lo}:{hi}")
    count = int(round(fraction * len(requests)))
    chosen = set(rng.choice(len(requests), size=count, replace=False).tolist())
    out = []
    for i, req in enumerate(requests):
        if i in chosen:
            length = int(rng.integers(lo, hi + 1))
            out.append(BenchRequest(tokens.sample(rng, length), req.output_len))
        else:
            out.append(req)
    return out
