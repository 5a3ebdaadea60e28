"""What a request must fit before an engine queues it: the model's vocabulary and context
length, and a guided-decoding spec that compiles. Checked on the caller's thread, so a bad
request is refused at once (the gateway turns the ValueError into a 400)."""

from __future__ import annotations

from pdserve.services.engine.guided import GuidedDecoder
from pdserve.shared.sampling import SamplingParams


def check_request(
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    vocab: int,
    max_model_len: int,
    guided: GuidedDecoder,
) -> None:
    """ValueError naming the first thing the request gets wrong."""
    if not prompt_token_ids:
        raise ValueError("prompt is empty")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(sampling, name) or 0) > vocab:
            raise ValueError(f"{name} must be at most the vocabulary size {vocab}")
    if any(not 0 <= t < vocab for t in sampling.logit_bias_token_ids):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    total = len(prompt_token_ids) + sampling.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
            f"exceeds the context length {max_model_len}"
        )
    if sampling.guided is not None:  # compiled here (then cached): a bad spec is refused now
        guided.compiler.compile(sampling.guided)
