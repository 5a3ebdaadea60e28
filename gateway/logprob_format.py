"""Log-probs in OpenAI's two shapes: the legacy completions object (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's ``content`` list of
``{token, logprob, bytes, top_logprobs}``.

A token's text is its own decoding, special tokens included (as vLLM shows them); a byte-level
token that is only part of a character decodes to U+FFFD, and ``bytes`` are that text's UTF-8.

And the response fields of vLLM's request extensions (``vllm_fields.py``), in vLLM's shapes.

- ``prompt_logprobs``: one entry per prompt token, null for the first (nothing predicts it),
  then ``{token id (a string, as JSON keys are): {"logprob", "rank", "decoded_token"}}``: the
  prompt's own token first with its rank in the whole vocabulary (1 = the likeliest), then the
  k likeliest with ranks 1..k. When the prompt's token is one of them it keeps its first place
  and takes that entry's values, as vLLM's dict does. On a completion choice (every choice of
  the prompt) or at the top of a chat completion, as vLLM puts them; never in a stream.
- ``return_token_ids``: ``prompt_token_ids`` (the prompt as served, after truncation) and
  ``token_ids`` (the choice's generated tokens: with a stop string, up to the event that
  matched it). In a stream each chunk's ``token_ids`` are its own tokens, and the prompt's ride
  on a choice's first chunk (completions) or on each role chunk (chat).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.tokenizer import ModelTokenizer
from pdserve.shared.sampling import TokenLogprobs


class TokenTexts:
    """Each token id's own text, decoded once."""

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok = tok
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = text
        return text


@dataclass
class LogprobEntry:
    token_id: int
    logprob: float | None  # None: the prompt's first token, which nothing predicts
    top: list[tuple[int, float]] | None = None


@dataclass
class LogprobList:
    """The log-probs of one choice's tokens, in order."""

    entries: list[LogprobEntry] = field(default_factory=list)

    def add(self, token_ids: list[int], logprobs: TokenLogprobs | None) -> list[LogprobEntry]:
        """Append ``token_ids`` with their log-probs; returns the new entries."""
        if logprobs is None or len(logprobs) != len(token_ids):
            raise ValueError("log-probs missing or not one per token")
        new = [
            LogprobEntry(t, logprobs.token_logprobs[i], logprobs.top(i))
            for i, t in enumerate(token_ids)
        ]
        self.entries.extend(new)
        return new

    def add_prompt(self, prompt_ids: list[int], logprobs: TokenLogprobs | None) -> None:
        """The prompt's tokens (echo): the first has no log-prob; the rest follow
        ``logprobs`` when given (prompt log-probs were asked)."""
        if not prompt_ids:
            return
        self.entries.append(LogprobEntry(prompt_ids[0], None))
        if logprobs is None:
            self.entries.extend(LogprobEntry(t, None) for t in prompt_ids[1:])
        else:
            self.add(prompt_ids[1:], logprobs)

    @property
    def cumulative(self) -> float:
        return sum(e.logprob for e in self.entries if e.logprob is not None)


def completion_logprobs(
    entries: list[LogprobEntry], texts: TokenTexts, offset: int = 0
) -> dict[str, Any]:
    """The legacy completions shape; ``offset`` is where the first token's text starts in the
    choice's text (a stream continues counting across chunks)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = texts(e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        tops.append(None if e.top is None else _top_dict(e, texts))
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _top_dict(e: LogprobEntry, texts: TokenTexts) -> dict[str, float]:
    """The legacy contract (OpenAI's, followed by vLLM): the position's own token (sampled, or
    the prompt's with echo) is always in the dict, beside the k likeliest, so it holds up to k + 1
    entries and exactly that token for ``logprobs: 0``. Clients such as lm-eval read the token's
    own log-prob and greediness from it. It goes first, as in vLLM, and keeps its own log-prob
    under its text, so ``top_logprobs[i][tokens[i]] == token_logprobs[i]``; other tokens that
    share a text keep the likeliest one's."""
    out: dict[str, float] = {texts(e.token_id): e.logprob}
    for token_id, logprob in e.top or []:
        out.setdefault(texts(token_id), logprob)
    return out


def text_length(entries: list[LogprobEntry], texts: TokenTexts) -> int:
    return sum(len(texts(e.token_id)) for e in entries)


def chat_logprobs(entries: list[LogprobEntry], texts: TokenTexts) -> dict[str, Any]:
    return {"content": [_chat_entry(e, texts) for e in entries]}


def _chat_entry(e: LogprobEntry, texts: TokenTexts) -> dict[str, Any]:
    item = _chat_token(e.token_id, e.logprob, texts)
    item["top_logprobs"] = [_chat_token(t, lp, texts) for t, lp in e.top or []]
    return item


def _chat_token(token_id: int, logprob: float | None, texts: TokenTexts) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def trim_alternatives(logprobs: TokenLogprobs, k: int) -> TokenLogprobs:
    """``logprobs`` with only the first (likeliest) ``k`` alternatives per token: the engine
    computes one count for echo's log-probs and for prompt_logprobs, the larger."""
    if logprobs.top_k <= k:
        return logprobs
    n, old = len(logprobs), logprobs.top_k
    keep = [i * old + j for i in range(n) for j in range(k)]
    return TokenLogprobs(
        top_k=k,
        token_logprobs=list(logprobs.token_logprobs),
        ranks=list(logprobs.ranks),
        top_token_ids=[logprobs.top_token_ids[i] for i in keep],
        top_logprobs=[logprobs.top_logprobs[i] for i in keep],
    )


def prompt_logprobs_json(
    prompt_ids: list[int], logprobs: TokenLogprobs, k: int, texts: TokenTexts
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt, ``k`` alternatives per token."""
    if len(logprobs) != max(0, len(prompt_ids) - 1):
        raise ValueError("prompt log-probs are not one per prompt token after the first")
    out: list[dict[str, Any] | None] = [None]
    for i, own in enumerate(prompt_ids[1:]):
        entry = {str(own): _logprob(logprobs.token_logprobs[i], logprobs.ranks[i], own, texts)}
        for rank, (token_id, logprob) in enumerate(logprobs.top(i)[:k], start=1):
            entry[str(token_id)] = _logprob(logprob, rank, token_id, texts)
        out.append(entry)
    return out


def _logprob(logprob: float, rank: int, token_id: int, texts: TokenTexts) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": texts(token_id)}
