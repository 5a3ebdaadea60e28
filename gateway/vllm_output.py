"""The response fields of vLLM's request extensions (``vllm_fields.py``), in vLLM's shapes.

- ``prompt_logprobs``: one entry per prompt token, null for the first (nothing predicts it),
  then ``{token id (a string, as JSON keys are): {"logprob", "rank", "decoded_token"}}``: the
  prompt's own token first with its rank in the whole vocabulary (1 = the likeliest), then the
  k likeliest with ranks 1..k. When the prompt's token is one of them it keeps its first place
  and takes that entry's values, as vLLM's dict does. On a completion choice (every choice of
  the prompt) or at the top of a chat completion, as vLLM puts them; never in a stream.
- ``return_token_ids``: ``prompt_token_ids`` (the prompt as served, after truncation) and
  ``token_ids`` (the choice's generated tokens: with a stop string, up to the event that
  matched it). In a stream each chunk's ``token_ids`` are its own tokens, and the prompt's ride
  on a choice's first chunk (completions) or on each role chunk (chat).
"""

from __future__ import annotations

from typing import Any

from pdserve.gateway.logprob_format import TokenTexts
from pdserve.shared.logprobs import TokenLogprobs


def trim_alternatives(logprobs: TokenLogprobs, k: int) -> TokenLogprobs:
    """``logprobs`` with only the first (likeliest) ``k`` alternatives per token: the engine
    computes one count for echo's log-probs and for prompt_logprobs, the larger."""
    if logprobs.top_k <= k:
        return logprobs
    n, old = len(logprobs), logprobs.top_k
    keep = [i * old + j for i in range(n) for j in range(k)]
    return TokenLogprobs(
        k,
        list(logprobs.token_logprobs),
        list(logprobs.ranks),
        [logprobs.top_token_ids[i] for i in keep],
        [logprobs.top_logprobs[i] for i in keep],
    )


def prompt_logprobs_json(
    prompt_ids: list[int], logprobs: TokenLogprobs, k: int, texts: TokenTexts
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt, ``k`` alternatives per token."""
    if len(logprobs) != max(0, len(prompt_ids) - 1):
        raise ValueError("prompt log-probs are not one per prompt token after the first")
    out: list[dict[str, Any] | None] = [None]
    for i, own in enumerate(prompt_ids[1:]):
        entry = {str(own): _logprob(logprobs.token_logprobs[i], logprobs.ranks[i], own, texts)}
        for rank, (token_id, logprob) in enumerate(logprobs.top(i)[:k], start=1):
            entry[str(token_id)] = _logprob(logprob, rank, token_id, texts)
        out.append(entry)
    return out


def _logprob(logprob: float, rank: int, token_id: int, texts: TokenTexts) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": texts(token_id)}
