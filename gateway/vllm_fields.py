"""vLLM's request extensions that RL frameworks, evaluation harnesses and agents written against
vLLM send, with vLLM's meaning (its ``CompletionRequest`` / ``ChatCompletionRequest``).

Both endpoints:

- ``prompt_logprobs`` (0..``MAX_LOGPROBS``): each prompt token's log-prob and rank, with that
  many likeliest alternatives (the response's ``prompt_logprobs``). vLLM's -1 (the whole
  vocabulary) is refused, as vLLM itself refuses it above its default ``--max-logprobs`` of 20.
  As in vLLM, above 0 it cannot be streamed, and a stream carries none.
- ``return_token_ids``: the prompt's and each choice's token ids beside the text.
- ``truncate_prompt_tokens`` (>= 1, or -1 for as many as fit): keep only the prompt's last k
  tokens (vLLM's left truncation); usage counts what was kept.

Chat only:

- ``add_generation_prompt`` (default true) goes to the template; ``continue_final_message``
  renders the last message open-ended so the model continues it (``tokenizer.py``). As in
  vLLM, the two cannot both be true; unlike vLLM (whose renderer then fails), a request that sends
  only ``continue_final_message: true`` gets ``add_generation_prompt`` false.
- ``echo``: the reply starts with the last message's content when that message has the reply's
  role (the assistant's, or with no generation prompt the last message's own).
- ``chat_template_kwargs``: extra variables for the template (``enable_thinking``), bounded;
  the names the gateway sets itself are refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.sampling_fields import bounded_integer, integer
from pdserve.gateway.schema_base import INVALID_VALUE, StrictModel, field_error, reported_whole
from pdserve.shared.sampling import MAX_LOGPROBS, MAX_MAX_TOKENS

TEMPLATE_KWARGS_MAX_KEYS = 32
TEMPLATE_KWARGS_MAX_CHARS = 32 * 1024  # as JSON: a template's switches, not a document store
TEMPLATE_KWARG_NAME = "^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # a name a Jinja template can refer to
# Set by the gateway itself (or, in transformers' apply_chat_template, its own parameters):
# a client's value would clash with, or silently shadow, the server's.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
    }
)


def _not_the_whole_vocabulary(value: Any) -> Any:
    if value == -1 and not isinstance(value, bool):
        raise PydanticCustomError(
            INVALID_VALUE,
            "-1 (every token of the vocabulary) is not served; give at most {hi} alternatives",
            {"hi": MAX_LOGPROBS},
        )
    return value


def _not_zero(value: int) -> int:
    if value == 0:
        raise PydanticCustomError(
            INVALID_VALUE, "must be >= 1 (the prompt tokens to keep), or -1 (as many as fit)"
        )
    return value


def _small_and_not_reserved(value: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if taken:
        raise PydanticCustomError(
            INVALID_VALUE, "key {key} is set by the server", {"key": repr(taken[0])}
        )
    if len(json.dumps(value)) > TEMPLATE_KWARGS_MAX_CHARS:
        raise PydanticCustomError(
            INVALID_VALUE,
            "must be at most {n} characters as JSON",
            {"n": TEMPLATE_KWARGS_MAX_CHARS},
        )
    return value


PromptLogprobs = Annotated[
    bounded_integer("prompt_logprobs"), BeforeValidator(_not_the_whole_vocabulary)
]
TruncatePromptTokens = Annotated[integer(-1, MAX_MAX_TOKENS), AfterValidator(_not_zero)]
TemplateKwargs = Annotated[
    dict[Annotated[str, Field(pattern=TEMPLATE_KWARG_NAME)], Any],
    Field(max_length=TEMPLATE_KWARGS_MAX_KEYS),
    AfterValidator(_small_and_not_reserved),
    reported_whole(),
]


class VllmFields(StrictModel):
    """vLLM's extensions both endpoints take."""

    prompt_logprobs: PromptLogprobs | None = Field(
        None,
        description="vLLM's: each prompt token's log-prob and rank plus this many likeliest "
        "alternatives, in the response's prompt_logprobs; above 0 not with stream (-1, the "
        "whole vocabulary, is refused)",
    )
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's: prompt_token_ids and each choice's token_ids beside the text "
        "(streamed: token_ids per chunk, prompt_token_ids on each choice's first chunk)",
    )
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None,
        description="vLLM's: keep only the prompt's last k tokens; -1 keeps as many as fit "
        "the context with max_tokens",
    )

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> VllmFields:
        if self.prompt_logprobs and getattr(self, "stream", None):
            raise field_error(
                "prompt_logprobs",
                INVALID_VALUE,
                "is not available when 'stream' is true (as in vLLM)",
                self.prompt_logprobs,
            )
        return self

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """GenerationParams.prompt_logprobs: a stream carries none, so none are computed."""
        return None if getattr(self, "stream", None) else self.prompt_logprobs


class TemplateFields(StrictModel):
    """vLLM's fields for how the chat template renders: the chat endpoint's and /tokenize's."""

    add_generation_prompt: bool | None = Field(
        None,
        description="vLLM's: passed to the chat template (default true, false with "
        "continue_final_message); false makes the reply's role the last message's",
    )
    continue_final_message: bool | None = Field(
        None,
        description="vLLM's: render the last message open-ended, for the model to continue "
        "it; not with add_generation_prompt true",
    )
    chat_template_kwargs: TemplateKwargs | None = Field(
        None,
        description="vLLM's: extra variables for the chat template (e.g. enable_thinking); at "
        f"most {TEMPLATE_KWARGS_MAX_KEYS} names, {TEMPLATE_KWARGS_MAX_CHARS} characters as JSON",
        json_schema_extra={"propertyNames": {"pattern": TEMPLATE_KWARG_NAME}},
    )

    @model_validator(mode="after")
    def _continue_or_generation_prompt(self) -> TemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error(
                "continue_final_message",
                INVALID_VALUE,
                "cannot be true with 'add_generation_prompt' true (as in vLLM)",
                True,
            )
        return self

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt as the template gets it."""
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return not self.continue_final_message


class ChatVllmFields(TemplateFields, VllmFields):
    """vLLM's extensions of the chat endpoint: how the template renders, and echo."""

    echo: bool | None = Field(
        None,
        description="vLLM's: the reply starts with the last message's content when that "
        "message has the reply's role",
    )
