"""The handlers of ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (``server.py``
reads the body and routes here).

A Messages request is lowered to the chat request it stands for (``lowering.py``), prepared as
the chat endpoint prepares its own (``prepare.chat_prompt``: template, tokens, reasoning,
grammar checks) and served by ``serving.serve_generation`` - admission, the dispatch through
prefill and decode, cancellation, metrics and the request span - with Anthropic's renderer
(``answer.respond``) in place of OpenAI's. Its span's operation is ``chat``, as GenAI's
semantic conventions name a chat request whatever its API.

``count_tokens`` renders the same conversation the same way, so its count is the prompt a
``/v1/messages`` request with those messages and tools is served with.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pdserve.gateway.anthropic.answer import respond
from pdserve.gateway.anthropic.lowering import parse_count, parse_messages
from pdserve.gateway.app_state import GATEWAY_KEY, Gateway
from pdserve.gateway.prepare import chat_prompt, chat_text, check_model, tool_format
from pdserve.gateway.prompting import encode
from pdserve.gateway.serving import serve_generation


async def messages(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    parser, tags = tool_format(gw)
    req = parse_messages(body, parser, tags)
    check_model(gw, req.params.model)
    prompt = await chat_prompt(gw, req)
    return await serve_generation(request, gw, "chat", req.params, [prompt], respond)


async def count_tokens(gw: Gateway, body: dict[str, Any]) -> dict[str, int]:
    parser, _ = tool_format(gw)
    req = parse_count(body, parser)
    check_model(gw, req.params.model)
    ids = await encode(gw.model.tokenizer, chat_text(gw, req), add_special_tokens=False)
    return {"input_tokens": len(ids)}
