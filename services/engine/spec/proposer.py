"""What a speculative-decoding method implements: drafts for the sequences about to decode.

The engine asks once per step, before scheduling, with every running sequence that is about to
decode and may speculate (``speculator.py`` decides which, and how many tokens each may draft).
A proposer answers per sequence; the step then verifies every draft in its forward pass. An
n-gram proposer (``ngram.py``) copies drafts from the sequence's own tokens; a draft-model
proposer runs a smaller model over the same sequences and also returns its distributions, which
rejection sampling needs (``rejection.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.services.engine.sequence import Sequence


@dataclass
class Proposal:
    """Drafted tokens that would follow a sequence's last token, likeliest continuation first."""

    token_ids: list[int]
    # [len(token_ids), V] float32: the distribution each token was drawn from (a draft model's),
    # on the engine's device; None for a point mass (q = 1 on the drafted token: n-gram)
    probs: torch.Tensor | None = None
    # how the draft was found, where that predicts its acceptance (n-gram: the length of the
    # matched suffix; a 1-token match drafts far worse than a 4-token one): adaptive K keeps
    # its acceptance rates per kind
    kind: int = field(default=0, compare=False)


class Proposer(ABC):
    """Drafts for a step's speculating sequences."""

    # what drafting one token took the last ``propose`` (a draft model's passes), None when
    # drafting costs no forward pass (n-gram): adaptive K adds it to a draft token's cost
    step_seconds: float | None = None
    # looking for a draft costs next to nothing (n-gram): the speculator asks for K tokens
    # first and then lets the draft's kind decide how many to verify, rather than sizing the
    # request from the sequence's acceptance before knowing what was found
    looks_first: bool = False

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Proposal | None]:
        """One answer per sequence, in order: a proposal of at most ``max_tokens[i]`` (>= 1)
        tokens, or None when it has nothing to draft. Called on the engine thread; a sequence's
        ``token_ids`` end with its last sampled token, whose KV is not computed yet."""

    def verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:  # noqa: B027
        """The step verified the first ``num_drafted`` tokens of ``seq``'s proposal (the
        scheduler may cut a proposal to fit the token budget or the free blocks) and accepted
        ``num_accepted`` of them: a draft model rolls its own cache back past them. The n-gram
        proposer keeps no state between steps."""

    def release(self, seq: Sequence) -> None:  # noqa: B027
        """``seq`` left the engine: let go of whatever is kept for it (a draft model's cache)."""
