"""Serving one generation request: admission, then the response the client asked for - streamed
as SSE (``gateway/streaming.py``) or collected into one JSON body (``gateway/whole_answer.py``)
from the same ``Generation`` (``gateway/generation.py``) - and the accounting once it is over:
metrics, the request span's GenAI attributes, and the tokens charged to the caller's API key
(``gateway/key_limits.py``, which may refuse the request with a 429 first).

The response is a ``Respond``: OpenAI's shapes by default; another API (Anthropic's Messages,
``gateway/anthropic/``) passes its own renderer of the same ``Generation``, so admission,
cancellation, metrics and spans exist once for every API.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry import trace

from pdserve.gateway.access import ANONYMOUS, KEY_ID_KEY, presented_key
from pdserve.gateway.api_models import GenerationParams, check_length
from pdserve.gateway.app_state import ARRIVED_KEY, CLIENT_ID_KEY, Gateway
from pdserve.gateway.generation import Generation, Progress, Prompt
from pdserve.gateway.streaming import stream_response
from pdserve.gateway.tenancy import check_priority, request_salt
from pdserve.gateway.whole_answer import complete
from pdserve.shared.telemetry import tracing as tr

# What answers an admitted generation: the HTTP response, built from its pieces as they come.
Respond = Callable[[web.Request, Generation], Awaitable[web.StreamResponse]]


async def openai_response(request: web.Request, gen: Generation) -> web.StreamResponse:
    """OpenAI's shapes: SSE chunks when the client asked for a stream, else one JSON body."""
    return await (stream_response(request, gen) if gen.params.stream else complete(gen))


async def serve_generation(
    request: web.Request,
    gw: Gateway,
    operation: str,
    params: GenerationParams,
    prompts: list[Prompt],
    respond: Respond = openai_response,
) -> web.StreamResponse:
    """Admit the request (``prompts``: already validated and tokenized), answer it with
    ``respond``, and account for it however it ends."""
    client_id: str = request[CLIENT_ID_KEY]
    check_priority(gw.scheduling_policy, params.priority)
    key = presented_key(request) if gw.config.api_key else ""
    salt = request_salt(gw.config.prefix_cache_scope, key, params.cache_salt)
    limit = gw.context_limit()
    max_tokens = [
        check_length(len(p.ids), params.max_tokens, limit, gw.config.max_prompt_tokens)
        for p in prompts
    ]
    total_prompt = sum(len(p.ids) for p in prompts)
    key_id = request.get(KEY_ID_KEY, ANONYMOUS)
    with gw.admissions.admit(client_id), gw.key_limits.admit(key_id, total_prompt) as ticket:
        root = trace.get_current_span()
        root.set_attributes(
            {
                tr.GEN_AI_OPERATION_NAME: operation,
                tr.GEN_AI_SYSTEM: "pdserve",
                tr.GEN_AI_REQUEST_MODEL: params.model,
                tr.GEN_AI_RESPONSE_MODEL: gw.model.name,
                tr.GEN_AI_REQUEST_MAX_TOKENS: max(max_tokens),
                tr.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                tr.GEN_AI_REQUEST_TOP_P: params.top_p,
                tr.GEN_AI_REQUEST_TOP_K: params.top_k,
                tr.GEN_AI_USAGE_INPUT_TOKENS: total_prompt,
            }
        )
        if params.seed is not None:
            root.set_attribute(tr.GEN_AI_REQUEST_SEED, params.seed)
        if params.n > 1:
            root.set_attribute(tr.GEN_AI_REQUEST_CHOICE_COUNT, params.n)
        gen = Generation(
            gw=gw,
            operation=operation,
            params=params,
            prompts=prompts,
            samplings=[gw.sampling_params(params, m, salt) for m in max_tokens],
            client_id=client_id,
            progress=Progress(
                prompt_tokens=total_prompt, arrived=request[ARRIVED_KEY], charge=ticket.charge
            ),
        )
        try:
            return await respond(request, gen)
        except BaseException:
            if gen.progress.finish_reason is None:
                gen.progress.finish_reason = "abort"  # client gone or an unexpected fault
            raise
        finally:
            progress = gen.progress
            e2e = time.monotonic() - progress.arrived
            gw.metrics.request_finished(
                progress.finish_reason or "abort",
                progress.prompt_tokens,
                progress.completion_tokens,
                e2e,
            )
            _finish_span(root, progress, client_id, e2e)


def _finish_span(span: trace.Span, progress: Progress, client_id: str, e2e: float) -> None:
    span.set_attribute(tr.GEN_AI_RESPONSE_ID, client_id)
    span.set_attribute(tr.GEN_AI_USAGE_OUTPUT_TOKENS, progress.completion_tokens)
    span.set_attribute(tr.GEN_AI_RESPONSE_FINISH_REASONS, [progress.finish_reason or "abort"])
    span.set_attribute(tr.GEN_AI_LATENCY_E2E, e2e)
    span.set_attribute(tr.ATTR_CACHED_TOKENS, progress.cached_tokens)
    if progress.first_token_at is not None:
        span.set_attribute(
            tr.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, progress.first_token_at - progress.arrived
        )
    if progress.first_token_at is not None and progress.last_token_at is not None:
        # As the gateway sees it: first token to last. Queue and forward times per phase are on
        # the workers' own spans.
        span.set_attribute(
            tr.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, progress.last_token_at - progress.first_token_at
        )
