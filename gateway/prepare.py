"""From a validated request to the prompt the workers are sent: the checks that need the served
model (its name, vocabulary, context and grammar compiler), and a chat request's conversation
rendered with the chat template and tokenized.

Every API that lowers to a chat request (``/v1/chat/completions``, Anthropic's ``/v1/messages``
in ``gateway/anthropic/``) goes through ``chat_prompt``, so the template, tools in the prompt,
reasoning, truncation and grammar checks exist once; ``/v1/completions`` shares the checks.
"""

from __future__ import annotations

import asyncio

from pdserve.gateway.api_models import ChatRequest, GenerationParams, check_param_token_ids
from pdserve.gateway.app_state import Gateway
from pdserve.gateway.errors import bad_request, model_not_found
from pdserve.gateway.generation import Prompt
from pdserve.gateway.prompting import encode, render_chat
from pdserve.gateway.reasoning import guided_after_reasoning, reasoning_setup
from pdserve.gateway.tokenizer import truncate_prompt
from pdserve.gateway.tools.grammar import check_schemas, tag_tokens
from pdserve.gateway.tools.prompt import resolve_parser
from pdserve.shared import structured_output

TagTokens = tuple[tuple[str, int], ...]


def check_model(gw: Gateway, model: str) -> None:
    """The base model's name, or one of the LoRA adapters the fleet serves; else a 404."""
    if model != gw.model.name and model not in gw.lora_adapters():
        raise model_not_found(model)


def tool_format(gw: Gateway) -> tuple[str, TagTokens]:
    """The format the served model writes tool calls in (``--tool-call-parser``, resolved for
    its template), and that format's tags its tokenizer has as one token each."""
    chat = gw.model.chat
    parser = resolve_parser(gw.config.tool_call_parser, chat.source if chat else None)
    tags = tag_tokens(parser, lambda t: gw.model.tokenizer.encode(t, add_special_tokens=False))
    return parser, tags


def chat_text(gw: Gateway, req: ChatRequest) -> str:
    """The conversation as prompt text: the chat template with the request's options and tools."""
    return render_chat(
        gw.model.chat,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        variables=req.template_kwargs,
        tools=req.params.tools,
        tool_parser=req.tool_parser,
    )


async def chat_prompt(gw: Gateway, req: ChatRequest) -> Prompt:
    """The prompt a chat request is served with, every check that needs the model passed."""
    text = chat_text(gw, req)
    # how the answer's reasoning is split out depends on where the template left it
    req.params.reasoning = reasoning_setup(gw.config.reasoning_parser, text, req.template_kwargs)
    req.params.guided = guided_after_reasoning(req.params.guided, req.params.reasoning)
    # The template writes BOS itself, so no special tokens are added (as transformers does).
    prompt_ids = await encode(gw.model.tokenizer, text, add_special_tokens=False)
    prompt_ids = truncated(gw, req.params, prompt_ids)
    check_param_token_ids(req.params, gw.model.tokenizer.vocab_size)
    # each enforced tool schema first, so that one that does not compile is named
    await asyncio.to_thread(check_schemas, req.params.tools, gw.model.tokenizer.tokenizer)
    await check_guided(gw, req.params)
    return Prompt(prompt_ids, text)


def truncated(gw: Gateway, params: GenerationParams, ids: list[int]) -> list[int]:
    limit, most = gw.context_limit(), gw.config.max_prompt_tokens
    return truncate_prompt(ids, params.truncate_prompt_tokens, params.max_tokens, limit, most)


async def check_guided(gw: Gateway, params: GenerationParams) -> None:
    """A grammar that does not compile is the client's 400 here, not a worker's error later.
    Off the event loop: the first check builds the tokenizer's grammar compiler (~0.3 s for a
    50k vocabulary), and a large schema takes a while to compile."""
    if params.guided is None:
        return
    try:
        await asyncio.to_thread(
            structured_output.check, params.guided, gw.model.tokenizer.tokenizer
        )
    except ValueError as exc:
        message = f"Invalid structured output: {exc}"
        raise bad_request(message, params.guided_param, "invalid_grammar") from None
