"""The rules the engine's speculative-decoding options must keep, checked when an
``EngineConfig`` is built (so every process refuses a bad combination before it starts).

They live apart from config.py, which declares the options: these are the one place that
says which combinations are allowed, read through the fields they need.
"""

from __future__ import annotations

from typing import Protocol

SPECULATIVE_METHODS = ("off", "ngram", "draft")


class SpeculativeOptions(Protocol):
    """The fields of ``EngineConfig`` the rules read."""

    tensor_parallel_size: int
    speculative: str
    num_speculative_tokens: int
    ngram_min: int
    ngram_max: int
    spec_token_cost: float
    draft_model: str | None


def speculative_problem(cfg: SpeculativeOptions) -> str | None:
    """What is wrong with the speculative-decoding options, in one line, or None."""
    if cfg.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be at least 1, got {cfg.tensor_parallel_size}"
    if cfg.speculative not in SPECULATIVE_METHODS:
        methods = ", ".join(SPECULATIVE_METHODS)
        return f"--speculative must be one of {methods}, got {cfg.speculative!r}"
    if cfg.num_speculative_tokens < 1:
        return f"--num-speculative-tokens must be at least 1, got {cfg.num_speculative_tokens}"
    if cfg.ngram_min < 1:
        return f"--ngram-min must be at least 1, got {cfg.ngram_min}"
    if cfg.ngram_min > cfg.ngram_max:
        return f"--ngram-min ({cfg.ngram_min}) exceeds --ngram-max ({cfg.ngram_max})"
    if cfg.spec_token_cost < 0.0 and cfg.spec_token_cost != -1.0:
        return f"--spec-token-cost must be -1 (measured) or >= 0, got {cfg.spec_token_cost}"
    if cfg.speculative == "draft":
        if not cfg.draft_model:
            return "--speculative draft needs --draft-model PATH (a model with --model's tokenizer)"
        return None
    if cfg.draft_model:
        return f"--draft-model is only used with --speculative draft (this is {cfg.speculative})"
    return None
