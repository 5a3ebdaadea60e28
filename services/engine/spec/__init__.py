"""Speculative decoding inside the continuous batch (``--speculative``), exact.

One step, with speculation on:

1. ``Speculator.propose`` (``speculator.py``) asks the proposer (``proposer.py``; n-gram
   prompt lookup in ``ngram.py``, a draft model in ``draft.py``) for drafts of the running
   sequences about to decode, each limited by its adaptive budget (``adaptive.py``: its
   acceptance rates, per kind of draft, against each draft length's measured cost,
   ``cost.py``), ``max_tokens`` and the context.
2. The scheduler gives a sequence with k drafts a row of 1 + k query tokens - its last sampled
   token, then the drafts - cutting the draft to the step's token budget, or dropping it rather
   than preempting anyone for its blocks. Decode rows, verification rows and prefill chunks
   share the forward pass; verification rows attend over their paged context as a group of
   their own (``model.py``).
3. The runner reads logits at every position of a verification row and samples them as
   1 + k rows, row j at output position n + j with the drafts before it as history, so logit
   processors (penalties, min_tokens, logit_bias) see the right output, and each row draws
   the noise of its own position (``verify.py``, ``sampler.py``). Draft j is accepted when row
   j drew it; the first row that did not draws the correction, and a fully accepted draft
   gains row k's token as a bonus. Greedy output is therefore token for token what it is with
   speculation off, and so is a seeded request's sampled output: n-gram drafts are a point
   mass, for which this is rejection sampling (min(1, p/q), then the normalised residual) with
   the sampler's own noise. Draft-model distributions go through ``rejection.py``.
4. The engine appends the accepted tokens (stopping at a stop token, EOS or ``max_tokens``
   like one-token steps do), rolls the rejected positions back - ``num_computed_tokens`` counts
   only accepted KV, and blocks holding nothing but rejected positions are freed, so the prefix
   cache never registers rejected tokens - and records the outcome (``SpecCounters``).

A prefill-only engine never speculates; on a decode worker speculation runs on whatever the
sequence holds, pulled KV or local. Guided (structured-output) sequences do not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.spec.cost import DraftCost
from pdserve.services.engine.spec.draft import load_draft
from pdserve.services.engine.spec.ngram import NgramProposer
from pdserve.services.engine.spec.proposer import Proposer
from pdserve.services.engine.spec.speculator import Speculator
from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError


@dataclass
class TargetModel:
    """What a draft model must agree with, and the cache it mirrors."""

    model_dir: Path
    config: ModelConfig
    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype


def build_speculator(
    config: EngineConfig, max_model_len: int, target: TargetModel
) -> Speculator | None:
    """The speculator ``config`` asks for, or None (``--speculative off``)."""
    if config.speculative == "off":
        return None
    proposer: Proposer
    if config.speculative == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    elif config.speculative == "draft" and config.draft_model:
        proposer = load_draft(
            config.draft_model,
            target.model_dir,
            target.config,
            target.num_blocks,
            target.block_size,
            target.device,
            target.dtype,
        )
    else:
        raise StartupError(f"--speculative {config.speculative} needs --draft-model")
    fixed = None if config.spec_token_cost == -1.0 else config.spec_token_cost
    return Speculator(proposer, config.num_speculative_tokens, DraftCost(fixed), max_model_len)
