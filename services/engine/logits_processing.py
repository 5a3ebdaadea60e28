"""Logit processors: what a request asks to change in the model's next-token logits, applied to
a whole step's rows at once, before log-probs are taken and before sampling.

The order is fixed, and the log-probs (``services/engine/logprobs.py``) see its result:

1. the allowed-token bitmask (structured output): disallowed tokens -> -inf;
2. penalties on the model's logits: the repetition penalty (HF's and vLLM's: a logit of a token
   seen in the prompt or the output is divided by it when positive, multiplied by it when
   negative), then OpenAI's frequency and presence penalties over the output tokens
   (``logit - count * frequency - (count > 0) * presence``);
3. ``logit_bias``, added (after the penalties, so a bias of +100 that forces a token is not
   scaled down by a repetition penalty);
4. ``min_tokens``: while a sequence has fewer output tokens than that, its EOS ids (unless it
   ignores EOS) and its ``stop_token_ids`` -> -inf.

Each part is built only when some row of the step uses it; the other rows of that part carry
neutral values (penalty 0 / 1, no bias entry), so their logits are left exactly as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.services.engine.sequence import Sequence

# Host list -> tensor on the step's device (the runner's pinned, non-blocking copy).
ToDevice = Callable[..., torch.Tensor]


@dataclass
class Penalties:
    presence: torch.Tensor  # [B] float32, 0 = off
    frequency: torch.Tensor  # [B] float32, 0 = off
    output_counts: torch.Tensor  # [B, V] float32: how often each token was generated so far
    repetition: torch.Tensor | None  # [B] float32, 1 = off; None when no row uses it
    seen: torch.Tensor | None  # [B, V] bool: in the prompt or the output (with ``repetition``)


@dataclass
class SparseLogits:
    """(row, token id) -> value pairs: a few entries per row of a [B, V] logits matrix."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place. ``bitmask`` is int32
    [B, ceil(V/32)], bit j of word w allowing token 32*w+j (xgrammar's and llguidance's layout);
    tokens past the mask's width (a vocabulary padded beyond the tokenizer's) are disallowed."""
    rows, vocab = logits.shape
    bit = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bit) & 1).reshape(rows, -1).bool()
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    if p.repetition is not None and p.seen is not None:
        rep = p.repetition[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(p.seen, penalized, logits)
    counts = p.output_counts
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)


def apply_sparse(logits: torch.Tensor, entries: SparseLogits) -> torch.Tensor:
    """Add each entry's value to its (row, token) logit, in place (-inf masks it)."""
    return logits.index_put_((entries.rows, entries.token_ids), entries.values, accumulate=True)


# ---- building the parts from a step's sequences (host lists, one copy each) -------------------


def build_penalties(seqs: Seq[Sequence], vocab: int, to_device: ToDevice) -> Penalties | None:
    rows = [i for i, s in enumerate(seqs) if s.sampling.has_penalties]
    if not rows:
        return None
    b = len(seqs)
    out_rows, out_ids = _flat_tokens(seqs, rows, lambda s: s.output_token_ids)
    out_rows_t, out_ids_t = to_device(out_rows), to_device(out_ids)
    counts = torch.zeros(b, vocab, dtype=torch.float32, device=out_rows_t.device)
    counts.index_put_((out_rows_t, out_ids_t), torch.ones_like(out_rows_t, dtype=counts.dtype),
                      accumulate=True)  # fmt: skip
    reps = [s.sampling.repetition_penalty for s in seqs]
    repetition = seen = None
    if any(r != 1.0 for r in reps):
        rep_rows = [i for i in rows if reps[i] != 1.0]
        # the output tokens are in ``counts`` already; the prompt's are added here
        p_rows, p_ids = _flat_tokens(seqs, rep_rows, lambda s: s.token_ids[: s.num_prompt_tokens])
        seen = counts > 0
        seen[to_device(p_rows), to_device(p_ids)] = True
        repetition = to_device(reps, torch.float32)
    return Penalties(
        presence=to_device([s.sampling.presence_penalty for s in seqs], torch.float32),
        frequency=to_device([s.sampling.frequency_penalty for s in seqs], torch.float32),
        output_counts=counts,
        repetition=repetition,
        seen=seen,
    )


def build_logit_bias(seqs: Seq[Sequence], to_device: ToDevice) -> SparseLogits | None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, s in enumerate(seqs):
        if s.sampling.logit_bias_token_ids:
            bias = s.sampling.logit_bias  # a dict: a token listed twice counts once, the last
            rows.extend([i] * len(bias))
            ids.extend(bias)
            values.extend(bias.values())
    if not rows:
        return None
    return SparseLogits(to_device(rows), to_device(ids), to_device(values, torch.float32))


def build_min_tokens_mask(
    seqs: Seq[Sequence], eos_token_ids: Seq[int], vocab: int, to_device: ToDevice
) -> SparseLogits | None:
    """-inf on the tokens that would end a sequence still short of its ``min_tokens``."""
    rows: list[int] = []
    ids: list[int] = []
    for i, s in enumerate(seqs):
        sp = s.sampling
        if s.num_output_tokens < sp.min_tokens and sp.guided is None:  # guided: in their mask
            enders = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
            enders = {t for t in enders if 0 <= t < vocab}  # other ids can never be sampled
            rows.extend([i] * len(enders))
            ids.extend(enders)
    if not rows:
        return None
    masked = [float("-inf")] * len(rows)
    return SparseLogits(to_device(rows), to_device(ids), to_device(masked, torch.float32))


def _flat_tokens(
    seqs: Seq[Sequence], rows: list[int], tokens_of: Callable[[Sequence], list[int]]
) -> tuple[list[int], list[int]]:
    flat_rows: list[int] = []
    flat_ids: list[int] = []
    for i in rows:
        tokens = tokens_of(seqs[i])
        flat_rows.extend([i] * len(tokens))
        flat_ids.extend(tokens)
    return flat_rows, flat_ids
