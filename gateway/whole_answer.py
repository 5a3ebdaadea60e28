"""A generation answered as one JSON body (no ``stream``): every choice collected, then the
completion or chat completion with the usage, and vLLM's extra fields when asked
(``logprob_format.py``: ``prompt_logprobs``, ``prompt_token_ids``, ``token_ids``).

With ``--reasoning-parser``, a chat choice's reasoning goes to the message's
``reasoning_content`` (``reasoning.split``) and the rest is its content. A chat choice with
tools has that content split into the message's ``content`` (None when the answer is only
calls) and ``tool_calls`` by ``tools.parsers.parse``. Both are the same readings a stream's
deltas join to; a choice finishes with ``tool_calls`` when it has calls and ended on its own."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from aiohttp import web

from pdserve.gateway.generation import FAULTS, Generation, fault_error
from pdserve.gateway.logprob_format import prompt_logprobs_json
from pdserve.gateway.reasoning import split
from pdserve.gateway.response_choice import Piece, ResponseChoice
from pdserve.gateway.tools.parsers import Call, parse
from pdserve.gateway.tools.stream import call_id


async def complete(gen: Generation) -> web.Response:
    try:
        async with contextlib.aclosing(gen.pieces()) as pieces:
            async for _ in pieces:
                pass
    except FAULTS as exc:
        raise fault_error(exc) from None
    body: dict[str, Any] = {
        "id": gen.response_id,
        "object": "chat.completion" if gen.chat else "text_completion",
        "created": int(time.time()),
        "model": gen.params.model,
        "choices": [_choice_json(gen, c) for c in gen.returned()],
        "usage": gen.progress.usage(),
    }
    if gen.chat:  # vLLM puts a chat's prompt fields at the top, a completion's in each choice
        body.update(_prompt_fields(gen, 0))
    return web.json_response(body, dumps=_dumps)


def _choice_json(gen: Generation, choice: ResponseChoice) -> dict[str, Any]:
    logprobs = None
    if choice.logprobs is not None:
        whole = Piece(text=choice.text, logprobs=choice.logprobs.entries)
        logprobs = gen.logprobs_json(choice, whole, 0)
    finish = choice.finish_reason or "stop"
    if gen.chat:
        message, finish = _message(gen, choice, finish)
        item = {
            "index": choice.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
    else:
        item = {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        item.update(_prompt_fields(gen, choice.prompt))
    if gen.params.return_token_ids:
        item["token_ids"] = choice.token_ids
    return item


def _message(gen: Generation, choice: ResponseChoice, finish: str) -> tuple[dict[str, Any], str]:
    """A chat choice's message and finish reason."""
    # chat echo: the reply starts with the last message (its log-probs are not repeated)
    echo = gen.params.chat_echo
    content: str | None = choice.text
    reasoning = None
    if choice.reasoning is not None:
        parts = split(choice.text, choice.reasoning)
        content, reasoning = parts.content, parts.reasoning
    calls: list[Call] = []
    if choice.tools is not None and content is not None:
        parsed = parse(content, choice.tools)
        content, calls = parsed.content, parsed.calls
    message: dict[str, Any] = {
        "role": gen.params.reply_role,
        "content": content if not echo else echo + (content or ""),
    }
    if choice.reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [call.json(call_id()) for call in calls]
        if finish == "stop":
            finish = "tool_calls"
    return message, finish


def _prompt_fields(gen: Generation, p: int) -> dict[str, Any]:
    """Prompt ``p``'s prompt_logprobs and prompt_token_ids, those that were asked."""
    out: dict[str, Any] = {}
    ids, logprobs, k = gen.prompts[p].ids, gen.prompt_logprobs[p], gen.params.prompt_logprobs
    if k is not None and logprobs is not None and gen.texts is not None:
        out["prompt_logprobs"] = prompt_logprobs_json(ids, logprobs, k, gen.texts)
    if gen.params.return_token_ids:
        out["prompt_token_ids"] = ids
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
