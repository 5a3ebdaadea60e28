"""The bodies of ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes, as pydantic
models: they validate a request and give ``/openapi.json`` its schemas.

``/tokenize`` takes text (``prompt``) or a conversation (``messages``, rendered with the chat
template as the chat endpoint renders it: the same template fields and tools), never both; the
request's shape picks the model (``tokenize_api.py``), so a chat-only field beside ``prompt``
is a 400 naming it. As in vLLM, ``model`` may be left out (the served model), special tokens
are added to text by default and not to a conversation (the template writes them), and
``return_token_strs`` adds each token's own string.

Strict as every other body (``schema_base.StrictModel``): unknown fields are a 400 unless
null; ``chat_template`` (vLLM's per-request template) is refused, as on the chat endpoint.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pdserve.gateway.request_bodies import ChatMessages
from pdserve.gateway.response_models import ResponseModel
from pdserve.gateway.sampling_fields import TokenId
from pdserve.gateway.schema_base import StrictModel
from pdserve.gateway.tools.request import ToolFields
from pdserve.gateway.vllm_fields import TemplateFields
from pdserve.shared.sampling import MAX_MAX_TOKENS


class TokenizeFields(StrictModel):
    model: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="the served model's name (default: the served model)"
    )
    return_token_strs: bool | None = Field(
        None, description="also return each token's own string (token_strs)"
    )


class TokenizeTextBody(TokenizeFields):
    """Text to tokenize."""

    prompt: str = Field(description="the text")
    add_special_tokens: bool | None = Field(
        None,
        description="add the tokenizer's special tokens (BOS) as a prompt gets them (default true)",
    )


class TokenizeChatBody(ToolFields, TemplateFields, TokenizeFields, ChatMessages):
    """A conversation to tokenize: rendered with the chat template exactly as the chat endpoint
    renders it (the template's fields and tools too), then tokenized."""

    add_special_tokens: bool | None = Field(
        None,
        description="add the tokenizer's special tokens on top of what the template writes "
        "(default false, as the chat endpoint does)",
    )

    @model_validator(mode="after")
    def _tool_results_answer_calls(self) -> TokenizeChatBody:
        self._check_tool_results()
        return self


class DetokenizeBody(StrictModel):
    """Token ids to turn back into text."""

    model: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="the served model's name (default: the served model)"
    )
    tokens: Annotated[list[TokenId], Field(max_length=MAX_MAX_TOKENS)] = Field(
        description="token ids of the served model's vocabulary"
    )


class TokenizeResponse(ResponseModel):
    count: int = Field(description="how many tokens")
    max_model_len: int = Field(description="longest prompt + output served (as /v1/models says)")
    tokens: list[int] = Field(description="the token ids")
    token_strs: list[str] | None = Field(
        description="each token's own string (as the vocabulary writes it), with "
        "return_token_strs; else null"
    )


class DetokenizeResponse(ResponseModel):
    prompt: str = Field(description="the text, special tokens included")
