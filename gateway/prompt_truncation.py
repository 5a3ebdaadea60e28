"""vLLM's ``truncate_prompt_tokens``: a prompt too long for the context keeps only its last k
tokens (vLLM's left truncation: the end of a prompt is what the model continues from)."""

from __future__ import annotations

from pdserve.gateway.errors import bad_request


def prompt_room(max_tokens: int | None, limit: int, max_prompt_tokens: int) -> int:
    """The most prompt tokens a request with ``max_tokens`` (None: the rest of the context) can
    have: the context less the output, and at least one position to generate into, as
    ``api_models.check_length`` requires; and no more than ``--max-prompt-tokens``."""
    room = limit - max(max_tokens or 1, 1)
    return min(room, max_prompt_tokens) if max_prompt_tokens else room


def truncate_prompt(
    ids: list[int], keep: int | None, max_tokens: int | None, limit: int, max_prompt_tokens: int
) -> list[int]:
    """``ids`` cut to its last ``keep`` tokens (-1: as many as fit); unchanged when ``keep`` is
    None or the prompt is short enough. As in vLLM, a ``keep`` that could never fit with
    ``max_tokens`` is a 400, however short this prompt is."""
    if keep is None:
        return ids
    room = prompt_room(max_tokens, limit, max_prompt_tokens)
    if keep == -1:
        keep = room
    elif keep > room:
        raise bad_request(
            f"'truncate_prompt_tokens' ({keep}) must be at most {room}: the context of {limit} "
            "tokens less max_tokens (and --max-prompt-tokens) leaves that many for the prompt",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    if keep < 1 or len(ids) <= keep:
        return ids  # nothing fits at all: check_length says why, naming max_tokens
    return ids[-keep:]
