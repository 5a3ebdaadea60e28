"""Vectorised sampling for a whole batch: logit processors, log-probs, greedy, temperature,
top-k, top-p, per-request seeds.

A step's logits go through, in order: the logit processors (``logits_processing.py``: grammar
mask, penalties, logit_bias, min_tokens), then the log-probs of the rows that ask for them
(``logprobs.py``: taken here, *before* temperature, top-k and top-p, so with no processor
active they are the model's own ``log_softmax`` at any temperature), then greedy rows take the
argmax of the processed logits and the others sample from them after temperature, top-k, top-p.

Randomness is counter-based (``noise.py``): the noise for a request's n-th output token is a
hash of (seed, n, vocab id). A request therefore samples the same tokens whatever it is batched
with, after preemption, and on whichever worker (prefill or decode) produces a given token.

Speculative decoding verifies drafted tokens through this same function: a sequence with k
drafts is k + 1 rows, row j standing at output position n + j with the drafts before it as its
history (``spec/verify.py``). Row j's token is what this sampler draws there, so an n-gram
draft (a point mass, q = 1 on the drafted token) is accepted exactly when the sampler draws it -
with probability p(draft), as rejection sampling's min(1, p/q) - and a rejection yields the
sampler's own draw, which then follows p without the draft, the normalised residual. Drafts with
a distribution q (a draft model) go through ``spec/rejection.py`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.services.engine.logits_processing import (
    Penalties,
    SparseLogits,
    apply_penalties,
    apply_sparse,
    apply_token_bitmask,
)
from pdserve.services.engine.logprobs import LogprobsTensors, gather_logprobs
from pdserve.services.engine.noise import uniform_noise
from pdserve.services.engine.spec.rejection import DraftDistributions, resolve_drafts

__all__ = ["SamplerOutput", "SamplingTensors", "process_logits", "sample", "uniform_noise"]


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ks: torch.Tensor  # [B] int64, vocab size when off
    top_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: index of the output token being sampled
    needs_filter: bool  # any row with top-k or top-p active
    all_greedy: bool
    # The parts below are None unless some row of the step uses them.
    # int32 [B, ceil(V/32)]: bit j of word w allows token 32*w+j (structured output)
    token_bitmask: torch.Tensor | None = None
    penalties: Penalties | None = None
    logit_bias: SparseLogits | None = None
    min_tokens_mask: SparseLogits | None = None  # -inf on EOS/stop ids of rows still too short
    logprob_rows: torch.Tensor | None = None  # [R] int64: rows whose sampled token's log-probs
    num_logprobs: int = 0  # top alternatives gathered for them: the largest any row asked
    draft: DraftDistributions | None = None  # drafted tokens with their q (a draft model)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # of the rows in ``SamplingTensors.logprob_rows``, in order


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """Pick one token per row of ``logits`` [B, V] (float32), and gather the log-probs asked."""
    logits = process_logits(logits, st)
    greedy_tokens = logits.argmax(dim=-1)
    if st.draft is not None:
        tokens = resolve_drafts(_target_probs(logits, st, greedy_tokens), st.draft, st.seeds,
                                st.steps, _sample_random(logits, st, greedy_tokens))  # fmt: skip
    elif st.all_greedy:
        tokens = greedy_tokens
    else:
        tokens = _sample_random(logits, st, greedy_tokens)
    logprobs = None
    if st.logprob_rows is not None:
        rows = st.logprob_rows
        logprobs = gather_logprobs(logits[rows], tokens[rows], st.num_logprobs)
    return SamplerOutput(tokens, logprobs)


def process_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The logit processors' result (a new tensor when any applies; ``logits`` is kept)."""
    parts = (st.token_bitmask, st.penalties, st.logit_bias, st.min_tokens_mask)
    if all(part is None for part in parts):
        return logits
    logits = logits.clone()
    if st.token_bitmask is not None:
        apply_token_bitmask(logits, st.token_bitmask)
    if st.penalties is not None:
        logits = apply_penalties(logits, st.penalties)
    if st.logit_bias is not None:
        apply_sparse(logits, st.logit_bias)
    if st.min_tokens_mask is not None:
        apply_sparse(logits, st.min_tokens_mask)
    return logits


def _random_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution a random row samples from: temperature, then top-k and top-p."""
    temps = torch.where(st.temperatures > 0, st.temperatures, torch.ones_like(st.temperatures))
    logits = logits / temps[:, None]
    if st.needs_filter:
        logits = _top_k_top_p(logits, st.top_ks, st.top_ps)
    return torch.softmax(logits, dim=-1)


def _target_probs(
    logits: torch.Tensor, st: SamplingTensors, greedy_tokens: torch.Tensor
) -> torch.Tensor:
    """Every row's distribution: greedy rows put all mass on their argmax."""
    one_hot = torch.nn.functional.one_hot(greedy_tokens, logits.shape[-1]).to(logits.dtype)
    if st.all_greedy:
        return one_hot
    return torch.where((st.temperatures > 0)[:, None], _random_probs(logits, st), one_hot)


def _sample_random(
    logits: torch.Tensor, st: SamplingTensors, greedy_tokens: torch.Tensor
) -> torch.Tensor:
    if st.all_greedy:
        return greedy_tokens
    probs = _random_probs(logits, st)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (a Gumbel-max equivalent).
    exp_noise = -torch.log(uniform_noise(st.seeds, st.steps, logits.shape[-1]))
    sampled = (probs / exp_noise).argmax(dim=-1)
    return torch.where(st.temperatures > 0, sampled, greedy_tokens)


def _top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    outside_k = ranks[None, :] >= top_ks[:, None]
    sorted_logits = sorted_logits.masked_fill(outside_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # keep the smallest prefix whose mass reaches top_p; the first token always survives
    outside_p = mass_before >= top_ps[:, None]
    sorted_logits = sorted_logits.masked_fill(outside_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
