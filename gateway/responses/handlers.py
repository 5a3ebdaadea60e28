"""The Responses API's endpoints: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``; ``install`` adds them and the
response store to the gateway's app.

``store`` defaults to true, as in OpenAI; without a store that can serve (a NATS without
JetStream), a request that leaves ``store`` out is answered all the same, unstored (its
response says ``store: false``), so plain requests never break on a deployment's bus. A request
that asks for the store explicitly - ``store: true``, ``previous_response_id``, or one of the
GET/DELETE endpoints - gets the store's error: a 400 ``response_store_unavailable`` without
JetStream, a 503 while the store has failed for now.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from pdserve.gateway.access import ANONYMOUS, KEY_ID_KEY, Access, add_route
from pdserve.gateway.api_models import check_length, validated
from pdserve.gateway.app_state import GATEWAY_KEY, Gateway
from pdserve.gateway.body import read_json
from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.prepare import chat_prompt, check_model, tool_format
from pdserve.gateway.responses.answer import ResponseTurn
from pdserve.gateway.responses.bodies import ResponsesBody
from pdserve.gateway.responses.conversation import (
    chat_request,
    input_items,
    new_id,
    read_items,
    stored_items,
)
from pdserve.gateway.responses.jetstream_store import JetStreamResponseStore
from pdserve.gateway.responses.store import (
    RESPONSE_ID,
    ResponseStore,
    StoredResponse,
    StoreFailed,
    failed,
)
from pdserve.gateway.serving import serve_generation

RESPONSE_STORE_KEY = web.AppKey("response_store", ResponseStore)
MAX_LIST = 100  # input_items' largest page, as OpenAI's


def install(app: web.Application, gw: Gateway, store: ResponseStore | None = None) -> None:
    """Add the endpoints and the store (default: JetStream's, on the gateway's bus), opened
    once the gateway has connected (register after the gateway's own start-up)."""
    config = gw.config
    store = store or JetStreamResponseStore(
        gw.bus, ttl=config.response_store_ttl, replicas=config.response_store_replicas or 1
    )
    app[RESPONSE_STORE_KEY] = store
    add_route(app, "POST", "/v1/responses", create_response, Access.USER)
    add_route(app, "GET", "/v1/responses/{response_id}", get_response, Access.USER)
    add_route(app, "DELETE", "/v1/responses/{response_id}", delete_response, Access.USER)
    add_route(app, "GET", "/v1/responses/{response_id}/input_items", list_input_items, Access.USER)

    async def open_store(app: web.Application) -> None:
        await store.open()

    async def close_store(app: web.Application) -> None:
        await store.close()

    app.on_startup.append(open_store)
    app.on_cleanup.insert(0, close_store)  # before the gateway closes the bus


async def create_response(request: web.Request) -> web.StreamResponse:
    gw, store = request.app[GATEWAY_KEY], request.app[RESPONSE_STORE_KEY]
    body = validated(ResponsesBody, await read_json(request))
    check_model(gw, body.model)
    if body.store:  # asked for explicitly: told when it cannot be done
        store.require("store")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = (
            await _stored(request, body.previous_response_id, "previous_response_id")
        ).conversation
    parser, tags = tool_format(gw)
    req = chat_request(body, read_items(history), parser, tags)
    prompt = await chat_prompt(gw, req)
    _check_length(gw, len(prompt.ids), body.max_output_tokens)
    turn = ResponseTurn(
        id=new_id("resp"),
        created_at=int(time.time()),
        settings=body.echo(),
        conversation=history + stored_items(input_items(body)),
        store=store if body.stores and store.ready else None,
        owner=request.get(KEY_ID_KEY, ANONYMOUS),
    )
    return await serve_generation(request, gw, "chat", req.params, [prompt], respond=turn)


# the chat parameters a length error names, as this API calls them
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens"}


def _check_length(gw: Gateway, prompt_tokens: int, max_output_tokens: int | None) -> None:
    """serve_generation's own length check, first, so that its 400 names this API's fields."""
    limit, most = gw.context_limit(), gw.config.max_prompt_tokens
    try:
        check_length(prompt_tokens, max_output_tokens, limit, most)
    except APIError as err:
        err.param = _PARAMS.get(err.param or "", err.param)
        err.message = err.message.replace("max_tokens", "max_output_tokens")
        raise


async def get_response(request: web.Request) -> web.Response:
    if request.query.get("stream", "false") != "false":
        raise bad_request("streaming a stored response again is not supported", "stream")
    record = await _stored(request, request.match_info["response_id"])
    return web.json_response(record.response)


async def delete_response(request: web.Request) -> web.Response:
    store, response_id = request.app[RESPONSE_STORE_KEY], request.match_info["response_id"]
    await _stored(request, response_id)  # another key's response is not there for this one
    try:
        deleted = await store.delete(response_id)
    except StoreFailed as exc:
        raise failed(str(exc)) from None
    if not deleted:
        raise _not_found(response_id, None)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """OpenAI's list: ``limit`` (1 to 100, default 20), ``order`` (``desc`` by default: the
    newest item first), ``after`` (an item id: the page starts after it)."""
    record = await _stored(request, request.match_info["response_id"])
    query = request.query
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST:
        raise bad_request(f"'limit' must be an integer from 1 to {MAX_LIST}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", "order")
    items = record.input_items if order == "asc" else record.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"'after' names no input item of {record.response['id']}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


async def _stored(
    request: web.Request, response_id: str, param: str | None = None
) -> StoredResponse:
    """The stored response the request's key may see, or the error: the store's own, or a 404
    naming ``param`` (another key's response is answered as one that does not exist, so its
    existence is not revealed either)."""
    store = request.app[RESPONSE_STORE_KEY]
    store.require(param)
    try:
        record = await store.get(response_id) if RESPONSE_ID.match(response_id) else None
    except StoreFailed as exc:
        raise failed(str(exc)) from None
    if record is None or not record.seen_by(request.get(KEY_ID_KEY, ANONYMOUS)):
        raise _not_found(response_id, param)
    return record


def _not_found(response_id: str, param: str | None) -> APIError:
    shown = response_id if len(response_id) <= 100 else response_id[:100] + "..."
    return APIError(
        404,
        f"Response with id '{shown}' not found (never stored, deleted, or expired).",
        type="invalid_request_error",
        param=param,
        code="not_found",
    )
