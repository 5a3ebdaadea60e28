"""From a request to prompt text and tokens: the chat template rendered with a request's
options, and tokenization that leaves the event loop for long texts.

The chat endpoint and ``POST /tokenize`` both render through ``render_chat``, so /tokenize
counts exactly the tokens a chat request with the same messages and options is served with.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.errors import bad_request, server_error
from pdserve.gateway.tokenizer import (
    ChatTemplate,
    ModelTokenizer,
    TemplateFailure,
    TemplateInputError,
)
from pdserve.gateway.tools.setup import ToolSetup

log = logging.getLogger(__name__)


BIG_PROMPT_CHARS = 20_000  # tokenize longer texts off the event loop


def render_chat(
    chat: ChatTemplate | None,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
    tools: ToolSetup | None,
    tool_parser: str,
) -> str:
    """The prompt text of a conversation; a 400 when the model has no template or the
    template refuses the messages, a 500 when the template itself fails."""
    if chat is None:
        raise bad_request("This model has no chat template; use /v1/completions", "messages")
    try:
        return chat.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=variables,
            tools=tools,
            tool_parser=tool_parser,
        )
    except TemplateInputError as exc:
        message = f"The chat template rejected the messages: {exc}"
        raise bad_request(message, exc.param) from None
    except TemplateFailure as exc:
        log.error("chat template failed: %s", exc)
        raise server_error("the model's chat template failed to render") from None


async def encode(tok: ModelTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids; a long text is tokenized in a thread, so other requests' streams
    keep flowing meanwhile."""
    if len(text) > BIG_PROMPT_CHARS:
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)
