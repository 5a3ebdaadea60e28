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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry import trace

from gateway.api_models import GenerationParams, check_length
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import APIError, overloaded, server_error, timeout_error
from gateway.inflight import NotSendable, NoWorker, StageTimeout, TokenEvent, WorkerFailure
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
            **self.running_usage(),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def running_usage(self) -> dict[str, Any]:
        """The usage so far, in the shape vLLM's continuous_usage_stats puts on every chunk."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


FAULTS = (NotSendable, NoWorker, StageTimeout, WorkerFailure)


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
    with gw.requests.admit(rid):
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
        gen = Generation(
            gw,
            operation,
            params,
            prompt_ids,
            sampling,
            rid,
            Progress(prompt_tokens=len(prompt_ids), arrived=request[ARRIVED_KEY]),
        )
        try:
            return await (_stream(request, gen) if params.stream else _complete(gen))
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


@dataclass
class Generation:
    """One admitted generation request and what it produced so far."""

    gw: Gateway
    operation: str
    params: GenerationParams
    prompt_ids: list[int]
    sampling: SamplingParams
    rid: str
    progress: Progress

    @property
    def chat(self) -> bool:
        return self.operation == "chat"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.rid

    async def texts(self) -> AsyncIterator[tuple[str, str | None]]:
        """The response text as it is generated: ``(text, None)`` per token event (the text
        may be empty), then one last ``(tail, finish_reason)``. Usage and latency go into
        ``progress`` on the way. Raises the dispatcher's faults (``FAULTS``)."""
        progress = self.progress
        out = OutputText(self.gw.model.tokenizer, self.params.stop)
        context = trace.set_span_in_context(trace.get_current_span())
        events = self.gw.dispatcher.generate(self.rid, self.prompt_ids, self.sampling, context)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    progress.tokens(self.gw, event)
                    text = out.add(event.token_ids)
                    if out.stopped:
                        progress.finish_reason = "stop"
                    elif event.finish_reason is not None:
                        progress.finish_reason = event.finish_reason
                    yield text, None
                    if out.stopped:
                        break  # closing the generator cancels the rest on the workers
        except FAULTS:
            progress.finish_reason = "error"
            raise
        tail = out.finish()
        if out.stopped:
            progress.finish_reason = "stop"
        yield tail, progress.finish_reason or "stop"


async def _complete(gen: Generation) -> web.Response:
    pieces: list[str] = []
    finish = "stop"
    try:
        async with contextlib.aclosing(gen.texts()) as texts:
            async for piece, ending in texts:
                pieces.append(piece)
                finish = ending or finish
    except FAULTS as exc:
        raise _fault(exc) from None
    text = "".join(pieces)
    body: dict[str, Any] = {
        "id": gen.response_id,
        "object": "chat.completion" if gen.chat else "text_completion",
        "created": int(time.time()),
        "model": gen.params.model,
        "usage": gen.progress.usage(),
    }
    if gen.chat:
        message = {"role": "assistant", "content": text}
        body["choices"] = [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        ]
    else:
        body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return web.json_response(body, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


class _Chunks:
    """The SSE chunks of one streamed response. With include_usage every chunk has a "usage"
    key, null (as OpenAI sends it) or with continuous_usage_stats the usage so far (as vLLM
    does), and ``usage_chunk`` is the extra last one with "choices": [] and the final usage."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.base = {
            "id": gen.response_id,
            "object": "chat.completion.chunk" if gen.chat else "text_completion",
            "created": int(time.time()),
            "model": gen.params.model,
        }

    def __call__(self, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.gen.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        payload = {**self.base, "choices": [choice]}
        params = self.gen.params
        if params.include_usage:
            payload["usage"] = (
                self.gen.progress.running_usage() if params.continuous_usage else None
            )
        return payload

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": self.gen.progress.usage()}

    async def open(self, request: web.Request) -> SSEWriter:
        # Opened at the first token, not before: faults until then still get a real HTTP status.
        w = await SSEWriter.open(request, {"x-request-id": self.gen.rid})
        if self.gen.chat:
            first = self(None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            if self.gen.params.continuous_usage:
                # The role comes before any generated text: none counted yet, as in vLLM.
                prompt = self.gen.progress.prompt_tokens
                first["usage"] = {**first["usage"], "completion_tokens": 0, "total_tokens": prompt}
            await w.send(first)
        return w


async def _stream(request: web.Request, gen: Generation) -> web.StreamResponse:
    chunk = _Chunks(gen)
    progress = gen.progress
    writer: SSEWriter | None = None
    tail, finish = "", "stop"
    try:
        async with contextlib.aclosing(gen.texts()) as texts:
            async for text, ending in texts:
                if ending is not None:
                    tail, finish = text, ending
                    break
                if writer is None:
                    writer = await chunk.open(request)
                if text:
                    await writer.send(chunk(text, None))
    except FAULTS as exc:
        err = _fault(exc)
        if writer is None:
            raise err from None
        log.warning("request %s failed mid-stream: %s", gen.rid, exc)
        await writer.send(err.body())
        await writer.done()
        return writer.response
    except ConnectionResetError:
        progress.finish_reason = "abort"  # the client went away; the workers were cancelled
        raise
    except Exception:
        # A bug must not look like a short but successful stream: end it with an error event.
        log.exception("request %s failed", gen.rid)
        progress.finish_reason = "error"
        if writer is None:
            raise
        await writer.send(server_error("internal server error").body())
        await writer.done()
        return writer.response
    if writer is None:
        writer = await chunk.open(request)
    if tail:
        await writer.send(chunk(tail, None))
    await writer.send(chunk(None if gen.chat else "", finish))
    if gen.params.include_usage:
        await writer.send(chunk.usage_chunk())
    await writer.done()
    return writer.response
