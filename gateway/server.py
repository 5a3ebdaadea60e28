"""The OpenAI-compatible HTTP gateway (aiohttp).

``create_app`` builds the application: middlewares for request ids, tracing, errors and API
keys; the endpoints; and, on start-up, the NATS connection, the worker registry and the
dispatcher. ``run`` is the ``pdserve gateway`` command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry

from gateway.api_models import (
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    check_length,
    check_token_ids,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from gateway.auth import api_key_middleware
from gateway.chat_template import ChatTemplate, TemplateFailure, TemplateInputError
from gateway.detokenizer import IncrementalDetokenizer
from gateway.dispatch import Dispatcher, NoWorker, StageTimeout, TokenEvent, WorkerFailure
from gateway.errors import (
    APIError,
    bad_request,
    model_not_found,
    overloaded,
    payload_too_large,
    server_error,
    timeout_error,
)
from gateway.openapi import openapi_spec
from gateway.router import Router
from gateway.sse import SSEWriter
from gateway.stop import StopStringMatcher
from gateway.tokenizer import ModelTokenizer
from services.engine.sampling import SamplingParams
from shared import tracing as tr
from shared.bus import Bus
from shared.config import BusConfig, EngineConfig, GatewayConfig, build
from shared.discovery import WorkerRegistry
from shared.metrics import GatewayMetrics, WorkerLoadCollector, metrics_handler
from shared.protocol import is_subject_token

log = logging.getLogger("pdserve.gateway")
_tracer = tr.tracer(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DRAIN_SECONDS = 30.0  # on SIGTERM, how long in-flight requests may finish
BIG_PROMPT_CHARS = 20_000  # tokenize longer prompts off the event loop
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ----------------------------------------------------------------------------- model


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    chat: ChatTemplate | None
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(cls, engine: EngineConfig) -> ServedModel:
        if engine.model:
            model_dir = Path(engine.model).expanduser()
            if not model_dir.is_dir():
                raise SystemExit(f"--model {engine.model}: not a directory")
        else:
            # Imported only here: making the demo model needs torch, which the gateway avoids.
            from services.engine.model_dir import resolve_model

            model_dir = resolve_model(None)
        tok = ModelTokenizer.from_dir(model_dir)
        chat = None
        if tok.chat_template is not None:
            chat = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
        return cls(
            name=engine.served_model_name or model_dir.name,
            tokenizer=tok,
            chat=chat,
            max_model_len=engine.max_model_len or _context_length(model_dir),
        )


def _context_length(model_dir: Path) -> int:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return value if isinstance(value, int) and value > 0 else 2048


def new_gateway_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"gw-{host}-{os.getpid()}-{secrets.token_hex(3)}"


# ----------------------------------------------------------------------------- state


class Gateway:
    """Everything the handlers share: config, model, bus side, metrics."""

    def __init__(
        self,
        config: GatewayConfig,
        engine: EngineConfig,
        bus_config: BusConfig,
        gateway_id: str | None = None,
    ) -> None:
        self.config = config
        self.bus_config = bus_config
        self.gateway_id = gateway_id or new_gateway_id()
        self.model = ServedModel.load(engine)
        self.block_size = engine.block_size
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.bus = Bus(bus_config, self.gateway_id)
        self.workers = WorkerRegistry(self.bus, config.worker_timeout)
        self.registry.register(WorkerLoadCollector(self.workers.loads))
        self.router = Router(self.workers.loads, engine.block_size, model=self.model.name)
        self.dispatcher = Dispatcher(
            self.bus,
            self.workers,
            self.router,
            self.gateway_id,
            config.request_timeout,
            config.prefill_timeout,
        )
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def start(self) -> None:
        await self.bus.connect()
        await self.workers.start()
        await self.dispatcher.start()
        log.info("gateway %s serving %s", self.gateway_id, self.model.name)

    async def stop(self) -> None:
        await self.workers.stop()
        await self.dispatcher.close()
        await self.bus.close()

    def healthy(self) -> tuple[bool, str]:
        if not self.bus.connected:
            return False, "not connected to NATS"
        if not self.router.has_decode():
            return False, "no decode worker is alive"
        return True, "ok"

    def sampling_params(self, p: GenerationParams, max_tokens: int) -> SamplingParams:
        eos = [] if p.ignore_eos else list(self.model.tokenizer.eos_token_ids)
        return SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            max_tokens=max_tokens,
            stop_token_ids=eos,
            ignore_eos=p.ignore_eos,
        )


GATEWAY_KEY = web.AppKey("gateway", Gateway)
REQUEST_ID_KEY = web.RequestKey("request_id", str)


# ----------------------------------------------------------------------------- middlewares


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request.headers.get("x-request-id")
    if rid is None or rid == "":
        rid = uuid.uuid4().hex
    elif not is_subject_token(rid):
        err = bad_request(
            "x-request-id must be 1-128 characters of letters, digits, '_', '-' or ':'",
            "x-request-id",
            "invalid_request_id",
        )
        response = err.response()
        response.headers["x-request-id"] = uuid.uuid4().hex
        return response
    request[REQUEST_ID_KEY] = rid
    response = await handler(request)
    if not response.prepared:
        response.headers["x-request-id"] = rid
    return response


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in GENERATION_PATHS:
        return await handler(request)
    # The HTTP server span is the trace's root (or joins a client's trace if it sent one).
    parent = tr.extract_context(request.headers)
    with _tracer.start_as_current_span(
        f"POST {request.path}", context=parent, kind=SpanKind.SERVER
    ) as span:
        span.set_attribute(tr.ATTR_REQUEST_ID, request[REQUEST_ID_KEY])
        span.set_attribute("http.request.method", "POST")
        span.set_attribute("url.path", request.path)
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI-shaped JSON; bad input never becomes a 5xx."""
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPRequestEntityTooLarge:
        return payload_too_large(request.app[GATEWAY_KEY].config.max_body_bytes).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found" if exc.status == 404 else "http_error"
        return APIError(exc.status, exc.reason or "HTTP error", code=kind).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return server_error("internal server error").response()


# ----------------------------------------------------------------------------- endpoints


async def health(request: web.Request) -> web.Response:
    ok, why = request.app[GATEWAY_KEY].healthy()
    return web.json_response(
        {"status": "ok" if ok else "unavailable", "detail": why}, status=200 if ok else 503
    )


async def models(request: web.Request) -> web.Response:
    model = request.app[GATEWAY_KEY].model
    card = {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "pdserve",
        "max_model_len": model.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_spec(request.app[GATEWAY_KEY].model.name))


async def _read_json(request: web.Request) -> dict[str, Any]:
    gw = request.app[GATEWAY_KEY]
    limit = gw.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise payload_too_large(limit)
    raw = await request.read()  # aiohttp enforces client_max_size while reading
    return parse_json_body(raw)


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    req: CompletionRequest = parse_completion(await _read_json(request))
    _check_model(gw, req.params.model)
    tok = gw.model.tokenizer
    if isinstance(req.prompt, str):
        prompt_ids = await _encode(tok, req.prompt, add_special_tokens=True)
    else:
        check_token_ids(req.prompt, tok.vocab_size)
        prompt_ids = req.prompt
    return await _serve(request, gw, "text_completion", req.params, prompt_ids)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    req: ChatRequest = parse_chat(await _read_json(request))
    _check_model(gw, req.params.model)
    if gw.model.chat is None:
        raise bad_request("This model has no chat template; use /v1/completions", "messages")
    try:
        text = gw.model.chat.render(req.messages, add_generation_prompt=True)
    except TemplateInputError as exc:
        raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from None
    except TemplateFailure as exc:
        log.error("chat template failed: %s", exc)
        raise server_error("the model's chat template failed to render") from None
    # The template writes BOS itself, so no special tokens are added (as transformers does).
    prompt_ids = await _encode(gw.model.tokenizer, text, add_special_tokens=False)
    return await _serve(request, gw, "chat", req.params, prompt_ids)


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.model.name:
        raise model_not_found(model)


async def _encode(tok: ModelTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > BIG_PROMPT_CHARS:
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)


# ----------------------------------------------------------------------------- generation


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
    if isinstance(exc, NoWorker):
        return overloaded(f"{exc}; retry shortly", retry_after=1.0)
    if isinstance(exc, StageTimeout):
        return timeout_error(f"request timed out: {exc}")
    if isinstance(exc, WorkerFailure):
        return APIError(
            502, f"worker error: {exc}", type="server_error", code=exc.code or "worker_error"
        )
    raise exc


async def _serve(
    request: web.Request,
    gw: Gateway,
    operation: str,
    params: GenerationParams,
    prompt_ids: list[int],
) -> web.StreamResponse:
    rid: str = request[REQUEST_ID_KEY]
    max_tokens = check_length(
        len(prompt_ids), params.max_tokens, gw.model.max_model_len, gw.config.max_prompt_tokens
    )
    sampling = gw.sampling_params(params, max_tokens)
    if gw.dispatcher.in_flight(rid):
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
            tr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
            tr.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            tr.GEN_AI_REQUEST_TOP_P: params.top_p,
            tr.GEN_AI_REQUEST_TOP_K: params.top_k,
            tr.GEN_AI_USAGE_INPUT_TOKENS: len(prompt_ids),
        }
    )
    if params.seed is not None:
        root.set_attribute(tr.GEN_AI_REQUEST_SEED, params.seed)

    progress = Progress(prompt_tokens=len(prompt_ids))
    gw.in_flight += 1
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
    except (NoWorker, StageTimeout, WorkerFailure) as exc:
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
    except (NoWorker, StageTimeout, WorkerFailure) as exc:
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


# ----------------------------------------------------------------------------- app


def create_app(
    config: GatewayConfig,
    engine: EngineConfig | None = None,
    bus: BusConfig | None = None,
    gateway_id: str | None = None,
) -> web.Application:
    gw = Gateway(config, engine or EngineConfig(), bus or BusConfig(), gateway_id)
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            request_id_middleware,
            tracing_middleware,
            error_middleware,
            api_key_middleware(config.api_key),
        ],
    )
    app[GATEWAY_KEY] = gw
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler(gw.registry))
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)

    async def on_startup(app: web.Application) -> None:
        await gw.start()

    async def on_cleanup(app: web.Application) -> None:
        await gw.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(app: web.Application, host: str, port: int, drain_seconds: float = 30.0) -> None:
    """Serve until SIGINT/SIGTERM, then let in-flight requests finish (bounded) and close."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    gw = app[GATEWAY_KEY]
    print(f"pdserve gateway listening on http://{host}:{port} as {gw.gateway_id}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: %d requests in flight", gw.in_flight)
    await site.stop()  # no new connections
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(gw.idle.wait(), drain_seconds)
    await runner.cleanup()


def run(ns: argparse.Namespace) -> int:
    config = build(GatewayConfig, ns)
    engine = build(EngineConfig, ns)
    bus = build(BusConfig, ns)
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    gateway_id = new_gateway_id()
    tr.setup_tracing(tr.SERVICE_GATEWAY, gateway_id)
    try:
        app = create_app(config, engine, bus, gateway_id)
        drain = min(config.request_timeout, DRAIN_SECONDS)
        asyncio.run(serve(app, config.host, config.port, drain_seconds=drain))
    finally:
        tr.shutdown_tracing()
    return 0
