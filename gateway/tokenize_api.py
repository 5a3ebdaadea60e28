"""``POST /tokenize`` and ``POST /detokenize``, as vLLM answers them.

``/tokenize`` gives the token ids of text, or of a conversation rendered with the chat template
through the chat endpoint's own code (``prompting.render_chat``, with the same tool-call parser
for a template without tool syntax), so its ``count`` is what a chat request with the same
messages and options is served with - before any ``truncate_prompt_tokens``, and without the
length check a generation gets (as vLLM: tokenizing a text too long to serve is not an error).
``/detokenize`` decodes ids, special tokens kept (vLLM's decode), after checking each against
the vocabulary.

The handlers' HTTP side (reading the body, the served model) is ``server.py``'s; these take the
parsed body and the model's pieces, so they stay apart from the gateway's live state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.gateway.api_models import chat_messages, check_token_ids, validated
from pdserve.gateway.errors import APIError, model_not_found
from pdserve.gateway.prompting import encode, render_chat
from pdserve.gateway.schema_base import INVALID_VALUE, MISSING
from pdserve.gateway.tokenize_bodies import DetokenizeBody, TokenizeChatBody, TokenizeTextBody
from pdserve.gateway.tokenizer import ChatTemplate, ModelTokenizer
from pdserve.gateway.tools.prompt import resolve_parser


@dataclass(frozen=True)
class Vocabulary:
    """What the two endpoints need of the served model."""

    name: str
    tokenizer: ModelTokenizer
    chat: ChatTemplate | None
    max_model_len: int  # as /v1/models says: the gateway's context limit now
    tool_call_parser: str  # --tool-call-parser, resolved for the template as the chat endpoint


def _check_model(served: Vocabulary, model: str | None) -> None:
    if model is not None and model != served.name:
        raise model_not_found(model)


def _body_kind(body: dict[str, Any]) -> type[TokenizeTextBody] | type[TokenizeChatBody]:
    """Text or a conversation, by the fields given (null counts as absent)."""
    text, chat = body.get("prompt") is not None, body.get("messages") is not None
    if text and chat:
        raise APIError(
            400,
            "give either 'prompt' (text) or 'messages' (a conversation), not both",
            param="messages",
            code=INVALID_VALUE,
        )
    if not text and not chat:
        raise APIError(
            400,
            "'prompt' (text) or 'messages' (a conversation) is required",
            param="prompt",
            code=MISSING,
        )
    return TokenizeChatBody if chat else TokenizeTextBody


async def tokenize(body: dict[str, Any], served: Vocabulary) -> dict[str, Any]:
    req = validated(_body_kind(body), body)
    _check_model(served, req.model)
    tok = served.tokenizer
    if isinstance(req, TokenizeTextBody):
        add_special = req.add_special_tokens is not False
        ids = await encode(tok, req.prompt, add_special_tokens=add_special)
    else:
        parser = resolve_parser(
            served.tool_call_parser, served.chat.source if served.chat else None
        )
        text = render_chat(
            served.chat,
            chat_messages(req.messages),
            add_generation_prompt=req.generation_prompt,
            continue_final_message=bool(req.continue_final_message),
            variables=dict(req.chat_template_kwargs or {}),
            tools=req.tool_setup(parser),
            tool_parser=parser,
        )
        ids = await encode(tok, text, add_special_tokens=bool(req.add_special_tokens))
    strs = None
    if req.return_token_strs:
        # an id past the tokenizer's own table (a padded vocabulary) has no string
        strs = [tok.tokenizer.id_to_token(i) or "" for i in ids]
    return {
        "count": len(ids),
        "max_model_len": served.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(body: dict[str, Any], served: Vocabulary) -> dict[str, Any]:
    req = validated(DetokenizeBody, body)
    _check_model(served, req.model)
    check_token_ids(req.tokens, served.tokenizer.vocab_size, "tokens")
    return {"prompt": served.tokenizer.decode(req.tokens, skip_special_tokens=False)}
