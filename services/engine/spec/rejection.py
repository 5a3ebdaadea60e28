"""Rejection sampling of drafted tokens that come with a distribution q (a draft model's).

Row r of a verification step stands at one output position of one sequence, with target
distribution p (the sampler's: processors, temperature, top-k, top-p; greedy rows a point mass
on their argmax). If a token d was drafted there from q, it is accepted with probability
min(1, p(d) / q(d)); a rejected draft is replaced by a draw from the normalised residual
max(0, p - q). Every draw is counter-based (``noise.py``): the accept coin from
(seed, position, ACCEPT), the residual draw from (seed, position, RESIDUAL), so a seeded
request stays reproducible. Rows without a draft (a sequence's bonus position after its last
draft, or a plain decode row) keep the plain sampler's token.

The emitted token of every row comes back as one tensor: the draft where accepted, else the
replacement. A draft is accepted exactly when the row's token equals it - a replacement never
does, since a rejection needs p(d) < q(d), where the residual is 0 - so the engine finds each
sequence's accepted length the same way for every proposer (``verify.py``). N-gram drafts
(q = 1 on the drafted token) skip this module: the sampler's own draw, accepted when it equals
the draft, is this scheme for a point mass (see ``sampler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.services.engine.noise import ACCEPT, RESIDUAL, purpose_seeds, uniform_noise


@dataclass
class DraftDistributions:
    """The drafted token of each sampling row and the distribution it was drawn from."""

    token_ids: torch.Tensor  # [R] int64, -1 where the row has no draft
    probs: torch.Tensor  # [R, V] float32 q, rows without a draft ignored


def resolve_drafts(
    target_probs: torch.Tensor,
    draft: DraftDistributions,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    plain_tokens: torch.Tensor,
) -> torch.Tensor:
    """Each row's emitted token: its draft when accepted, a residual draw when rejected, its
    ``plain_tokens`` entry (the plain sampler's) when it has no draft."""
    has_draft = draft.token_ids >= 0
    drafted = draft.token_ids.clamp(min=0)[:, None]
    p = target_probs.gather(1, drafted)[:, 0]
    q = draft.probs.gather(1, drafted)[:, 0].to(p.dtype)
    coin = uniform_noise(purpose_seeds(seeds, ACCEPT), steps, 1)[:, 0].to(p.dtype)
    # u < p / q without dividing: q > 0 for a token drawn from q; p == 0 is never accepted
    accepted = has_draft & (coin * q < p)
    residual = (target_probs - draft.probs.to(target_probs.dtype)).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p <= q everywhere means p == q: nothing is ever rejected there, so any fallback will do
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs)
    race = -torch.log(uniform_noise(purpose_seeds(seeds, RESIDUAL), steps, residual.shape[-1]))
    replacement = (residual / race).argmax(dim=-1)
    return torch.where(accepted, drafted[:, 0], torch.where(has_draft, replacement, plain_tokens))
