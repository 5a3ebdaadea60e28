"""The OpenAI-compatible HTTP gateway (aiohttp).

``create_app`` builds the application: the middlewares (``gateway/middlewares.py``: request ids,
tracing, errors; ``gateway/access.py``: keys), the endpoints with their access classes, the HTTP
parser's limits, and, on start-up, the NATS connection, the worker
registry and the dispatcher. ``run`` is the ``pdserve gateway`` command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from aiohttp import web

from pdserve.gateway import admin, lora_admin, tokenize_api
from pdserve.gateway.access import Access, KeyPolicy, access_middleware, add_route
from pdserve.gateway.anthropic import handlers as anthropic
from pdserve.gateway.api_models import (
    ChatRequest,
    CompletionRequest,
    check_param_token_ids,
    check_token_ids,
    parse_chat,
    parse_completion,
)
from pdserve.gateway.app_state import (
    GATEWAY_KEY,
    Gateway,
    new_gateway_id,
)
from pdserve.gateway.body import read_json
from pdserve.gateway.endpoint_metrics import endpoint_metrics_middleware
from pdserve.gateway.generation import Prompt
from pdserve.gateway.http_log import http_logger
from pdserve.gateway.middlewares import (
    error_middleware,
    request_id_middleware,
    tracing_middleware,
)
from pdserve.gateway.openapi import openapi_spec
from pdserve.gateway.prepare import (
    chat_prompt,
    check_guided,
    check_model,
    tool_format,
    truncated,
)
from pdserve.gateway.prompting import encode
from pdserve.gateway.responses import handlers as responses
from pdserve.gateway.responses.store import ResponseStore
from pdserve.gateway.serving import serve_generation
from pdserve.gateway.tokenize_api import Vocabulary
from pdserve.shared.bus.connection import Bus
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
from pdserve.shared.options import build
from pdserve.shared.telemetry import tracing as tr
from pdserve.shared.telemetry.metrics import metrics_handler

log = logging.getLogger(__name__)


DRAIN_SECONDS = 30.0  # on SIGTERM, how long in-flight requests may finish


async def health(request: web.Request) -> web.Response:
    ok, why = request.app[GATEWAY_KEY].healthy()
    return web.json_response(
        {"status": "ok" if ok else "unavailable", "detail": why}, status=200 if ok else 503
    )


def _model_card(gw: Gateway) -> dict[str, Any]:
    return {
        "id": gw.model.name,
        "object": "model",
        "created": gw.model.created,
        "owned_by": "pdserve",
        "max_model_len": gw.context_limit(),
        # which checkpoint serves (a rollout switches it): the routed workers' versions
        "model_versions": sorted(
            {w.model_version for r in ("prefill", "decode") for w in gw.router.serving(r)} - {""}
        ),
    }


def _adapter_card(gw: Gateway, name: str) -> dict[str, Any]:
    """A LoRA adapter as a model of its own: its ``parent`` is the base model (vLLM's shape)."""
    return {**_model_card(gw), "id": name, "root": name, "parent": gw.model.name}


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    cards = [_model_card(gw)] + [_adapter_card(gw, a) for a in gw.lora_adapters()]
    return web.json_response({"object": "list", "data": cards})


async def model(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    name = request.match_info["model"]
    check_model(gw, name)
    return web.json_response(_model_card(gw) if name == gw.model.name else _adapter_card(gw, name))


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_spec(request.app[GATEWAY_KEY].model.name))


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    req: CompletionRequest = parse_completion(await read_json(request))
    check_model(gw, req.params.model)
    tok = gw.model.tokenizer
    prompts: list[Prompt] = []
    for i, prompt in enumerate(req.prompts):
        where = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            given = await encode(tok, prompt, add_special_tokens=True)
        else:
            check_token_ids(prompt, tok.vocab_size, where)
            given = prompt
        ids = truncated(gw, req.params, given)
        # echo returns the prompt as given, or as served when it was truncated or token ids
        text = prompt if isinstance(prompt, str) and ids is given else ""
        if req.params.echo and not text:
            text = tok.decode(ids, skip_special_tokens=False)
        prompts.append(Prompt(ids, text))
    check_param_token_ids(req.params, tok.vocab_size)
    await check_guided(gw, req.params)
    return await serve_generation(request, gw, "text_completion", req.params, prompts)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    parser, tags = tool_format(gw)
    req: ChatRequest = parse_chat(await read_json(request), parser, tags)
    check_model(gw, req.params.model)
    prompt = await chat_prompt(gw, req)
    return await serve_generation(request, gw, "chat", req.params, [prompt])


def _vocabulary(gw: Gateway) -> Vocabulary:
    return Vocabulary(
        name=gw.model.name,
        tokenizer=gw.model.tokenizer,
        chat=gw.model.chat,
        max_model_len=gw.context_limit(),
        tool_call_parser=gw.config.tool_call_parser,
    )


async def tokenize(request: web.Request) -> web.Response:
    served = _vocabulary(request.app[GATEWAY_KEY])
    return web.json_response(await tokenize_api.tokenize(await read_json(request), served))


async def detokenize(request: web.Request) -> web.Response:
    served = _vocabulary(request.app[GATEWAY_KEY])
    return web.json_response(tokenize_api.detokenize(await read_json(request), served))


async def messages(request: web.Request) -> web.StreamResponse:
    return await anthropic.messages(request, await read_json(request))


async def count_tokens(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    return web.json_response(await anthropic.count_tokens(gw, await read_json(request)))


def create_app(
    config: GatewayConfig,
    engine: EngineConfig | None = None,
    bus: BusConfig | None = None,
    gateway_id: str | None = None,
    message_bus: Bus | None = None,  # tests: an in-memory bus (tests/bus_memory.py)
    response_store: ResponseStore | None = None,  # tests: a store in memory; default JetStream's
) -> web.Application:
    gw = Gateway(config, engine or EngineConfig(), bus or BusConfig(), gateway_id, message_bus)
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            endpoint_metrics_middleware(gw.metrics_registry),
            request_id_middleware,
            tracing_middleware,
            error_middleware,
            access_middleware(
                KeyPolicy(config.api_key, config.admin_api_key, config.metrics_api_key)
            ),
        ],
        # aiohttp's parser limits (a 400 beyond them, before any route) and its keep-alive
        # timer, which also bounds how long a client may take to send its headers (slowloris);
        # the body's deadline is body.py's.
        handler_args={
            "max_line_size": config.http_max_line_size,
            "max_field_size": config.http_max_field_size,
            "max_headers": config.http_max_headers,
            "keepalive_timeout": config.http_keepalive_timeout,
            "logger": http_logger(),  # a flood of malformed requests is no flood of tracebacks
        },
    )
    app[GATEWAY_KEY] = gw
    # Every route with its access class (gateway/access.py); tests/unit/test_access.py fails
    # on a route added without one.
    add_route(app, "GET", "/health", health, Access.OPEN)
    add_route(app, "GET", "/openapi.json", openapi, Access.OPEN)
    add_route(app, "GET", "/metrics", metrics_handler(gw.metrics_registry), Access.METRICS)
    add_route(app, "GET", "/v1/models", models, Access.USER)
    add_route(app, "GET", "/v1/models/{model:.+}", model, Access.USER)  # names may hold "/"
    add_route(app, "POST", "/v1/completions", completions, Access.USER)
    add_route(app, "POST", "/v1/chat/completions", chat_completions, Access.USER)
    add_route(app, "POST", "/v1/messages", messages, Access.USER)  # Anthropic's Messages API
    add_route(app, "POST", "/v1/messages/count_tokens", count_tokens, Access.USER)
    add_route(app, "POST", "/tokenize", tokenize, Access.USER)
    add_route(app, "POST", "/detokenize", detokenize, Access.USER)
    add_route(app, "POST", "/reset_prefix_cache", admin.reset_prefix_cache, Access.ADMIN)
    add_route(app, "POST", "/v1/load_lora_adapter", lora_admin.load_lora_adapter, Access.ADMIN)
    add_route(app, "POST", "/v1/unload_lora_adapter", lora_admin.unload_lora_adapter, Access.ADMIN)

    async def on_startup(app: web.Application) -> None:
        await gw.start()

    async def on_cleanup(app: web.Application) -> None:
        await gw.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    responses.install(app, gw, response_store)  # its store opens on the gateway's bus, after it
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
    log.info("stopping: %d requests in flight", gw.admitted_count)
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
        drain = min(config.request_timeout or DRAIN_SECONDS, DRAIN_SECONDS)  # 0: no cap
        asyncio.run(serve(app, config.host, config.port, drain_seconds=drain))
    finally:
        tr.shutdown_tracing()
    return 0
