"""Prompt-lookup decoding: drafts copied from the sequence's own tokens.

The last n tokens of a sequence (prompt and output so far), n from ``max_n`` down to ``min_n``,
are looked up earlier in the same tokens; the tokens that followed the match are the draft. It
needs no model and shines where the output quotes its input: editing, summaries, RAG answers,
code. Among candidate matches the longest wins, then the one with the most tokens after it
(up to the draft's length), then the latest (recent text predicts best).

Each sequence's tokens live in a numpy array that grows with it (only new tokens are copied per
step), and the search is a few array operations: the positions holding the last token, then,
for those candidates only, how far back each match reaches. Per sequence it is host work of
tens of microseconds, as in vLLM's n-gram proposer; nothing touches the device.
"""

from __future__ import annotations

import weakref

import numpy as np

from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.spec.proposer import Proposal, Proposer


class TokenArray:
    """A sequence's token ids as a growing int64 array (amortised doubling)."""

    def __init__(self) -> None:
        self.data = np.empty(64, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Catch up with ``token_ids`` (tokens are only ever appended) and view them."""
        n = len(token_ids)
        if n > self.size:
            if n > len(self.data):
                grown = np.empty(max(n, 2 * len(self.data)), dtype=np.int64)
                grown[: self.size] = self.data[: self.size]
                self.data = grown
            self.data[self.size : n] = token_ids[self.size : n]
            self.size = n
        return self.data[:n]


def find_draft(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> np.ndarray:
    """The tokens that followed the best earlier match of the last n tokens (empty if none)."""
    return find_match(tokens, min_n, max_n, max_tokens)[0]


def find_match(
    tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int
) -> tuple[np.ndarray, int]:
    """``find_draft``'s draft and the length of the match it follows (0: none)."""
    size = len(tokens)
    none = tokens[:0], 0
    if size < min_n + 1:
        return none
    # candidate match ends: earlier positions holding the last token (the last one itself is
    # the suffix, not a match)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not len(ends):
        return none
    # how far back each candidate agrees with the suffix, up to max_n tokens
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, size - 1)):
        starts = ends - back
        ok = starts >= 0
        ok[ok] = tokens[starts[ok]] == tokens[size - 1 - back]
        alive &= ok
        if not alive.any():
            break
        lengths += alive
    good = lengths >= min_n
    if not good.any():
        return none
    ends, lengths = ends[good], lengths[good]
    follow = np.minimum(size - 1 - ends, max_tokens)  # tokens after the match, up to the limit
    # longest match, then the longest continuation, then the latest
    best = np.lexsort((ends, follow, lengths))[-1]
    start = ends[best] + 1
    return tokens[start : start + follow[best]], int(lengths[best])


class NgramProposer(Proposer):
    looks_first = True  # a lookup is tens of microseconds

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # each sequence's token array lives as long as the sequence
        self._arrays: weakref.WeakKeyDictionary[Sequence, TokenArray] = weakref.WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for seq, limit in zip(seqs, max_tokens, strict=True):
            array = self._arrays.get(seq)
            if array is None:
                array = self._arrays[seq] = TokenArray()
            draft, n = find_match(array.sync(seq.token_ids), self.min_n, self.max_n, limit)
            out.append(Proposal(draft.tolist(), kind=n) if len(draft) else None)
        return out
