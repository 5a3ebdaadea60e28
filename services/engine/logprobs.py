"""Log-probs of chosen tokens, their ranks and the top alternatives, gathered for a whole step.

Which logits: those the logit processors left (``services/engine/sampler.py``:
the grammar mask, penalties, logit_bias, min_tokens), before temperature, top-k and top-p. With
no processor active they are the ``log_softmax`` of the model's logits whatever the temperature
(as vLLM documents its default). -inf (a masked token) is reported as ``MIN_LOGPROB``.

Two callers: the sampler, for the sampled token of each row that asks (one ``log_softmax`` and
one ``topk`` over those rows), and the runner, for prompt tokens during prefill. A prompt chunk
may hold thousands of positions: the LM head runs over bounded slices of them
(``PROMPT_SLICE``), keeping only the gathered numbers, so no [positions, vocab] matrix larger
than one slice ever exists. Everything stays on the device until the step's single read-back;
slicing per sequence happens on the host lists (``token_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.shared.sampling import MIN_LOGPROB, TokenLogprobs

if TYPE_CHECKING:
    from pdserve.services.engine.sequence import Sequence

PROMPT_SLICE = 256  # prompt positions per LM-head slice


@dataclass
class LogprobsTensors:
    """N chosen tokens' log-probs, ranks and top-k alternatives (k = the largest asked)."""

    token_logprobs: torch.Tensor  # [N] float32
    ranks: torch.Tensor  # [N] int64, 1 = the likeliest
    top_ids: torch.Tensor  # [N, k] int64, likeliest first
    top_logprobs: torch.Tensor  # [N, k] float32

    def cpu(self) -> LogprobsTensors:
        return LogprobsTensors(
            token_logprobs=self.token_logprobs.cpu(),
            ranks=self.ranks.cpu(),
            top_ids=self.top_ids.cpu(),
            top_logprobs=self.top_logprobs.cpu(),
        )

    @staticmethod
    def cat(parts: list[LogprobsTensors]) -> LogprobsTensors:
        if len(parts) == 1:
            return parts[0]
        return LogprobsTensors(
            token_logprobs=torch.cat([p.token_logprobs for p in parts]),
            ranks=torch.cat([p.ranks for p in parts]),
            top_ids=torch.cat([p.top_ids for p in parts]),
            top_logprobs=torch.cat([p.top_logprobs for p in parts]),
        )


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """For each row of ``logits`` [N, V] (float32): ``token_ids[row]``'s log-prob and rank, and
    the ``k`` likeliest tokens."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None])
    # rank = 1 + how many tokens are strictly likelier (ties share the better rank)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        token_logprobs=_finite(chosen[:, 0]),
        ranks=ranks,
        top_ids=top_ids,
        top_logprobs=_finite(top_logprobs),
    )


def gather_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    next_token_ids: torch.Tensor,
    k: int,
) -> LogprobsTensors:
    """Log-probs of ``next_token_ids[i]`` given position i, whose final hidden state is
    ``hidden[i]``: the LM head runs over ``PROMPT_SLICE`` positions at a time."""
    parts = [
        gather_logprobs(
            compute_logits(hidden[s : s + PROMPT_SLICE]), next_token_ids[s : s + PROMPT_SLICE], k
        )
        for s in range(0, hidden.shape[0], PROMPT_SLICE)
    ]
    return LogprobsTensors.cat(parts)


def token_logprobs(host: LogprobsTensors, start: int, stop: int, k: int) -> TokenLogprobs:
    """Entries ``start:stop`` of host tensors as the wire's flat lists, with the first ``k``
    alternatives of each (a step gathers the largest k any of its sequences asked for)."""
    return TokenLogprobs(
        top_k=k,
        token_logprobs=host.token_logprobs[start:stop].tolist(),
        ranks=host.ranks[start:stop].tolist(),
        top_token_ids=host.top_ids[start:stop, :k].flatten().tolist(),
        top_logprobs=host.top_logprobs[start:stop, :k].flatten().tolist(),
    )


def _finite(logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs.masked_fill(logprobs == float("-inf"), MIN_LOGPROB)


@dataclass
class PromptLogprobsPlan:
    """Which positions of a step's flat token batch gather prompt log-probs (host lists)."""

    flat_indices: list[int]  # into the flat batch: positions whose next prompt token is scored
    next_token_ids: list[int]  # the prompt token each of them predicts
    spans: list[tuple[int, int, int, int]]  # (index in batch.seqs, first entry, stop entry, k)
    k: int  # the largest asked in the step

    @staticmethod
    def build(
        seqs: list[Sequence], counts: list[int], starts: list[int], offsets: list[int]
    ) -> PromptLogprobsPlan | None:
        """Entry j of a sequence's prompt log-probs scores prompt token j+1 from position j;
        a chunk computing positions [start, start+count) gathers the entries it can that the
        sequence has not gathered before (a recompute after preemption adds none twice)."""
        plan = PromptLogprobsPlan(flat_indices=[], next_token_ids=[], spans=[], k=0)
        for i, (seq, count, start) in enumerate(zip(seqs, counts, starts, strict=True)):
            if not seq.needs_prompt_logprobs:
                continue
            first = max(start, len(seq.prompt_logprobs_so_far))
            stop = min(start + count, seq.num_prompt_tokens - 1)
            if first >= stop:
                continue
            entry = len(plan.flat_indices)
            plan.flat_indices.extend(range(offsets[i] + first - start, offsets[i] + stop - start))
            plan.next_token_ids.extend(seq.token_ids[first + 1 : stop + 1])
            k = seq.sampling.prompt_logprobs or 0
            plan.spans.append((i, entry, entry + stop - first, k))
            plan.k = max(plan.k, k)
        return plan if plan.spans else None
