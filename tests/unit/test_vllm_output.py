"""The gateway's side of two vLLM request extensions, on plain lists: ``truncate_prompt_tokens``
(which tokens are kept, and when it is a 400) and the ``prompt_logprobs`` shape built from the
engine's lists. The chat-template extensions, checked against transformers, are
tests/engine/test_vllm_rendering.py."""

from __future__ import annotations

import pytest

from pdserve.gateway.errors import APIError
from pdserve.gateway.logprob_format import prompt_logprobs_json, trim_alternatives
from pdserve.gateway.tokenizer import prompt_room, truncate_prompt
from pdserve.shared.sampling import TokenLogprobs

# ----------------------------------------------------------------------------- truncation


def test_truncation_keeps_the_last_tokens():
    ids = list(range(100, 140))
    assert truncate_prompt(ids, None, 16, 64, 0) is ids
    assert truncate_prompt(ids, 10, 16, 64, 0) == ids[-10:]
    assert truncate_prompt(ids, 40, 16, 64, 0) == ids  # already short enough
    assert truncate_prompt(ids, -1, 30, 64, 0) == ids[-34:]  # the context less max_tokens
    assert truncate_prompt(ids, -1, None, 32, 0) == ids[-31:]  # one position to generate into
    assert truncate_prompt(ids, -1, 0, 32, 0) == ids[-31:]  # echo's max_tokens 0 too
    assert truncate_prompt(ids, -1, 4, 64, 20) == ids[-20:]  # and --max-prompt-tokens
    assert prompt_room(16, 64, 0) == 48 and prompt_room(16, 64, 20) == 20


@pytest.mark.parametrize("keep, max_tokens, most", [(49, 16, 0), (21, 4, 20), (64, None, 0)])
def test_a_truncation_that_cannot_fit_is_a_400(keep, max_tokens, most):
    with pytest.raises(APIError) as info:
        truncate_prompt([1, 2, 3], keep, max_tokens, 64, most)  # however short the prompt
    assert (info.value.status, info.value.param) == (400, "truncate_prompt_tokens")


# ----------------------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_shape():
    texts = lambda t: f"<{t}>"  # noqa: E731
    # three prompt tokens: two scored, with two alternatives each
    logprobs = TokenLogprobs(2, [-1.5, -0.25], [7, 1], [9, 8, 4, 6], [-0.5, -0.9, -0.25, -3.0])
    got = prompt_logprobs_json([3, 5, 4], logprobs, 2, texts)
    assert got[0] is None
    assert got[1] == {
        "5": {"logprob": -1.5, "rank": 7, "decoded_token": "<5>"},  # the prompt's own, first
        "9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
        "8": {"logprob": -0.9, "rank": 2, "decoded_token": "<8>"},
    }
    # the prompt's token among the likeliest keeps first place, as in vLLM's dict
    assert list(got[2]) == ["4", "6"] and got[2]["4"]["rank"] == 1
    fewer = prompt_logprobs_json([3, 5, 4], logprobs, 1, texts)
    assert list(fewer[1]) == ["5", "9"] and list(fewer[2]) == ["4"]
    assert prompt_logprobs_json([3], TokenLogprobs(), 0, texts) == [None]
    with pytest.raises(ValueError):
        prompt_logprobs_json([3, 5], logprobs, 2, texts)


def test_trimmed_alternatives_keep_the_likeliest():
    logprobs = TokenLogprobs(3, [-1.0, -2.0], [2, 5], [1, 2, 3, 4, 5, 6], [-0.1, -0.2, -0.3] * 2)
    one = trim_alternatives(logprobs, 1)
    assert (one.top_k, one.top(0), one.top(1)) == (1, [(1, -0.1)], [(4, -0.1)])
    assert (one.token_logprobs, one.ranks) == (logprobs.token_logprobs, logprobs.ranks)
    assert trim_alternatives(logprobs, 3) is logprobs
