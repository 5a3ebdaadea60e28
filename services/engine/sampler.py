"""Vectorised sampling for a whole batch: logit processors, log-probs, greedy, temperature,
top-k, top-p, per-request seeds.

A step's logits go through, in order: the logit processors (below: grammar mask, penalties,
logit_bias, min_tokens), then the log-probs of the rows that ask for them
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

The logit processors: what a request asks to change in the model's next-token logits, applied to
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
from pdserve.services.engine.logprobs import LogprobsTensors, gather_logprobs
from pdserve.services.engine.noise import uniform_noise
from pdserve.services.engine.spec.rejection import DraftDistributions, resolve_drafts

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


def build_penalties(seqs: Seq[Sequence], vocab: int, to_device: ToDevice) -> Penalties | None:
    rows = [i for i, s in enumerate(seqs) if s.sampling.has_penalties]
    if not rows:
        return None
    b = len(seqs)
    out_rows, out_ids = _flat_tokens(seqs, rows, lambda s: s.output_token_ids)
    out_rows_t, out_ids_t = to_device(out_rows), to_device(out_ids)
    counts = torch.zeros(b, vocab, dtype=torch.float32, device=out_rows_t.device)
    counts.index_put_(
        (out_rows_t, out_ids_t), torch.ones_like(out_rows_t, dtype=counts.dtype), accumulate=True
    )
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
        tokens = resolve_drafts(
            _target_probs(logits, st, greedy_tokens),
            st.draft,
            st.seeds,
            st.steps,
            _sample_random(logits, st, greedy_tokens),
        )
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
