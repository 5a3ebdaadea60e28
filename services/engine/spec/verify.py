"""Verification rows: a sequence with k drafts samples as k + 1 rows, and keeps the prefix of
its drafts that those rows drew.

Row j of a sequence stands at output position ``num_output_tokens + j`` and sees the first j
drafts as if they were output already: ``DraftPosition`` shows the sequence that way to the
code that builds a step's sampling tensors (penalties count the drafts before it, min_tokens
counts them, the noise is drawn for that position). Rows are built lazily: a history list is
only made for the rows of sequences whose processors read it.

``emitted_tokens`` then compares each row's token with its draft, for every verification row
of the step at once (``accepted_lengths``), on the host copy of the sampled tokens (no extra
device sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.services.engine.sequence import Sequence
    from pdserve.shared.sampling import SamplingParams


class DraftPosition:
    """``seq`` as it would stand after its first ``j`` drafts (j >= 1), for sampling row j."""

    __slots__ = ("seq", "j")

    def __init__(self, seq: Sequence, j: int) -> None:
        self.seq = seq
        self.j = j

    @property
    def sampling(self) -> SamplingParams:
        return self.seq.sampling

    @property
    def seed(self) -> int:
        return self.seq.seed

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.j

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.spec_token_ids[: self.j]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.spec_token_ids[: self.j]


def sampling_rows(seqs: list[Sequence]) -> list[Sequence | DraftPosition]:
    """The rows that sample for ``seqs``: each sequence, then one row per draft token."""
    rows: list[Sequence | DraftPosition] = []
    for seq in seqs:
        rows.append(seq)
        rows.extend(DraftPosition(seq, j) for j in range(1, len(seq.spec_token_ids) + 1))
    return rows


def emitted_tokens(tokens: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """What each sequence emits, from its rows' ``tokens`` (host, flat, 1 + len(draft) per
    sequence): its accepted drafts and the token its rows drew after them."""
    flat = tokens.tolist()
    out: list[list[int]] = []
    first = 0
    for draft, accepted in zip(drafts, accepted_lengths(tokens, drafts), strict=True):
        out.append(flat[first : first + 1 + accepted])
        first += 1 + len(draft)
    return out


def accepted_lengths(tokens: torch.Tensor, drafts: list[list[int]]) -> list[int]:
    """For sequences whose rows sampled ``tokens`` (host, flat, 1 + len(draft) per sequence, in
    order), how many leading drafts each row drew: the accepted draft length."""
    if not any(drafts):
        return [0] * len(drafts)
    counts = torch.tensor([len(d) for d in drafts])
    width = int(counts.max())
    # the rows that verify a draft token: row j of a sequence checks its draft j
    firsts = torch.cumsum(counts + 1, 0) - (counts + 1)
    j = torch.arange(width)
    valid = j[None, :] < counts[:, None]
    index = (firsts[:, None] + j[None, :]).clamp(max=len(tokens) - 1)
    drafted = torch.zeros(len(drafts), width, dtype=tokens.dtype)
    drafted[valid] = torch.tensor([t for d in drafts for t in d], dtype=tokens.dtype)
    match = (tokens[index] == drafted) & valid
    # leading run of matches: cumprod stops at the first mismatch
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1).tolist()
