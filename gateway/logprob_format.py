"""Log-probs in OpenAI's two shapes: the legacy completions object (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's ``content`` list of
``{token, logprob, bytes, top_logprobs}``.

A token's text is its own decoding, special tokens included (as vLLM shows them); a byte-level
token that is only part of a character decodes to U+FFFD, and ``bytes`` are that text's UTF-8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.tokenizer import ModelTokenizer
from pdserve.shared.logprobs import TokenLogprobs


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
