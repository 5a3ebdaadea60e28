"""Serving one generation request: tokens from the dispatcher in, OpenAI responses out.

``serve_generation`` admits the request, streams it as SSE or collects it into one JSON body,
turns tokens into text (incremental detokenization, then stop strings), and accounts usage,
metrics and the request span's GenAI attributes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry import trace

from gateway.api_models import GenerationParams, check_length
from gateway.detokenizer import IncrementalDetokenizer
from gateway.dispatch import NotSendable, NoWorker, StageTimeout, TokenEvent, WorkerFailure
from gateway.errors import APIError, overloaded, server_error, timeout_error
from gateway.sse import SSEWriter
from gateway.state import ARRIVED_KEY, REQUEST_ID_KEY, Gateway
from gateway.stop import StopStringMatcher
from gateway.tokenizer import ModelTokenizer
from shared import tracing as tr
from shared.sampling import SamplingParams

log = logging.getLogger("pdserve.gateway")


class OutputText:
    """Tokens in, client text out: incremental detokenization, then stop strings."""

    def __init__(self, tok: ModelTokenizer, stops: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tok)
        self.stops = StopStringMatcher(stops)
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        text, self.stopped = self.stops.feed(self.detok.add(token_ids))
        return text

    def finish(self) -> str:
        if self.stopped:
            return ""
        text, self.stopped = self.stops.feed(self.detok.finish())
        return text if self.stopped else text + self.stops.flush()


@dataclass
class Progress:
    """What one request has produced so far, for usage, metrics and spans."""

    prompt_tokens: int
    arrived: float = field(default_factory=time.monotonic)
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None

    def tokens(self, gw: Gateway, event: TokenEvent) -> None:
        now = time.monotonic()
        n = len(event.token_ids)
        if event.cached_tokens is not None:
            self.cached_tokens = event.cached_tokens
        if n == 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            gw.metrics.ttft.observe(now - self.arrived)
            n -= 1
        if n > 0 and self.last_token_at is not None:
            gap = (now - self.last_token_at) / n
            for _ in range(n):
                gw.metrics.itl.observe(gap)
        self.completion_tokens += len(event.token_ids)
        self.last_token_at = now

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _fault(exc: Exception) -> APIError:
    if isinstance(exc, NotSendable):
        return APIError(400, f"The request cannot be sent to the workers: {exc}")
    if isinstance(exc, NoWorker):
        return overloaded(f"{exc}; retry shortly", retry_after=1.0)
    if isinstance(exc, StageTimeout):
        return timeout_error(f"request timed out: {exc}")
    if isinstance(exc, WorkerFailure) and exc.code in ("overloaded", "draining"):
        return overloaded(f"workers are busy: {exc}; retry shortly", retry_after=1.0)
    if isinstance(exc, WorkerFailure) and exc.code == "deadline":
        return timeout_error(f"request timed out on a worker: {exc}")
    if isinstance(exc, WorkerFailure):
        return APIError(
            502, f"worker error: {exc}", type="server_error", code=exc.code or "worker_error"
        )
    raise exc


async def serve_generation(
    request: web.Request,
    gw: Gateway,
    operation: str,
    params: GenerationParams,
    prompt_ids: list[int],
) -> web.StreamResponse:
    rid: str = request[REQUEST_ID_KEY]
    max_tokens = check_length(
        len(prompt_ids), params.max_tokens, gw.context_limit(), gw.config.max_prompt_tokens
    )
    sampling = gw.sampling_params(params, max_tokens)
    if rid in gw.active_ids:
        raise APIError(
            409,
            f"a request with x-request-id {rid} is already in flight",
            param="x-request-id",
            code="duplicate_request_id",
        )
    if gw.in_flight >= gw.config.max_queue:
        raise overloaded(f"the gateway has {gw.in_flight} requests in flight", retry_after=1.0)

    root = trace.get_current_span()
    root.set_attributes(
        {
            tr.GEN_AI_OPERATION_NAME: operation,
            tr.GEN_AI_SYSTEM: "pdserve",
            tr.GEN_AI_REQUEST_MODEL: params.model,
            tr.GEN_AI_RESPONSE_MODEL: gw.model.name,
            tr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
            tr.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            tr.GEN_AI_REQUEST_TOP_P: params.top_p,
            tr.GEN_AI_REQUEST_TOP_K: params.top_k,
            tr.GEN_AI_USAGE_INPUT_TOKENS: len(prompt_ids),
        }
    )
    if params.seed is not None:
        root.set_attribute(tr.GEN_AI_REQUEST_SEED, params.seed)

    progress = Progress(prompt_tokens=len(prompt_ids), arrived=request[ARRIVED_KEY])
    gw.in_flight += 1
    gw.active_ids.add(rid)
    gw.idle.clear()
    gw.metrics.in_flight.inc()
    try:
        if params.stream:
            return await _stream(request, gw, operation, params, prompt_ids, sampling, progress)
        return await _complete(gw, operation, params, prompt_ids, sampling, progress, rid)
    except BaseException:
        if progress.finish_reason is None:
            progress.finish_reason = "abort"  # client gone (cancelled) or an unexpected fault
        raise
    finally:
        gw.in_flight -= 1
        gw.active_ids.discard(rid)
        gw.metrics.in_flight.dec()
        if gw.in_flight == 0:
            gw.idle.set()
        e2e = time.monotonic() - progress.arrived
        gw.metrics.request_finished(
            progress.finish_reason or "abort",
            progress.prompt_tokens,
            progress.completion_tokens,
            e2e,
        )
        _finish_span(root, progress, rid, e2e)


def _finish_span(span: trace.Span, progress: Progress, rid: str, e2e: float) -> None:
    span.set_attribute(tr.GEN_AI_RESPONSE_ID, rid)
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


def _response_id(operation: str, rid: str) -> str:
    return ("chatcmpl-" if operation == "chat" else "cmpl-") + rid


def _events(gw: Gateway, rid: str, prompt_ids: list[int], sampling: SamplingParams):
    context = trace.set_span_in_context(trace.get_current_span())
    return gw.dispatcher.generate(rid, prompt_ids, sampling, context)


async def _complete(
    gw: Gateway,
    operation: str,
    params: GenerationParams,
    prompt_ids: list[int],
    sampling: SamplingParams,
    progress: Progress,
    rid: str,
) -> web.Response:
    out = OutputText(gw.model.tokenizer, params.stop)
    pieces: list[str] = []
    try:
        async with contextlib.aclosing(_events(gw, rid, prompt_ids, sampling)) as events:
            async for event in events:
                progress.tokens(gw, event)
                pieces.append(out.add(event.token_ids))
                if out.stopped:
                    progress.finish_reason = "stop"
                    break  # closing the generator cancels the rest on the workers
                if event.finish_reason is not None:
                    progress.finish_reason = event.finish_reason
    except (NotSendable, NoWorker, StageTimeout, WorkerFailure) as exc:
        progress.finish_reason = "error"
        raise _fault(exc) from None
    pieces.append(out.finish())
    if out.stopped:
        progress.finish_reason = "stop"
    text = "".join(pieces)
    finish = progress.finish_reason or "stop"
    body: dict[str, Any] = {
        "id": _response_id(operation, rid),
        "object": "chat.completion" if operation == "chat" else "text_completion",
        "created": int(time.time()),
        "model": params.model,
        "usage": progress.usage(),
    }
    if operation == "chat":
        message = {"role": "assistant", "content": text}
        body["choices"] = [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        ]
    else:
        body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return web.json_response(body, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


async def _stream(
    request: web.Request,
    gw: Gateway,
    operation: str,
    params: GenerationParams,
    prompt_ids: list[int],
    sampling: SamplingParams,
    progress: Progress,
) -> web.StreamResponse:
    rid: str = request[REQUEST_ID_KEY]
    chat = operation == "chat"
    base = {
        "id": _response_id(operation, rid),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": params.model,
    }

    def chunk(text: str | None, finish: str | None, usage: dict | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        payload = {**base, "choices": [choice]}
        if params.include_usage:
            payload["usage"] = usage
        return payload

    out = OutputText(gw.model.tokenizer, params.stop)
    writer: SSEWriter | None = None

    async def open_stream() -> SSEWriter:
        # Opened at the first token, not before: faults until then still get a real HTTP status.
        w = await SSEWriter.open(request, {"x-request-id": rid})
        if chat:
            first = chunk(None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await w.send(first)
        return w

    try:
        async with contextlib.aclosing(_events(gw, rid, prompt_ids, sampling)) as events:
            async for event in events:
                progress.tokens(gw, event)
                text = out.add(event.token_ids)
                if writer is None:
                    writer = await open_stream()
                if text:
                    await writer.send(chunk(text, None))
                if out.stopped:
                    progress.finish_reason = "stop"
                    break
                if event.finish_reason is not None:
                    progress.finish_reason = event.finish_reason
    except (NotSendable, NoWorker, StageTimeout, WorkerFailure) as exc:
        progress.finish_reason = "error"
        err = _fault(exc)
        if writer is None:
            raise err from None
        log.warning("request %s failed mid-stream: %s", rid, exc)
        await writer.send(err.body())
        await writer.done()
        return writer.response
    except ConnectionResetError:
        progress.finish_reason = "abort"  # the client went away; the workers were cancelled
        raise
    except Exception:
        # A bug must not look like a short but successful stream: end it with an error event.
        log.exception("request %s failed", rid)
        progress.finish_reason = "error"
        if writer is None:
            raise
        await writer.send(server_error("internal server error").body())
        await writer.done()
        return writer.response
    tail = out.finish()
    if out.stopped:
        progress.finish_reason = "stop"
    if writer is None:
        writer = await open_stream()
    if tail:
        await writer.send(chunk(tail, None))
    final = chunk(None if chat else "", progress.finish_reason or "stop", progress.usage())
    await writer.send(final)
    await writer.done()
    return writer.response
