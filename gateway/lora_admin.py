"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's endpoints and
bodies: ``{"lora_name", "lora_path"}``, ``{"lora_name"}``), access class admin: adapters served
from then on, or no more, by every worker of the fleet.

Every live worker is asked at once over NATS (``shared/discovery/lora_admin.py``); the answer
lists each one's outcome. A load is all or nothing: 200 when every worker loaded it; else the
workers that did unload it again, and the answer is 400 when a worker refused the adapter (its
reason: an unreadable directory, a rank above ``--max-lora-rank``, projections the engine does
not adapt, a worker without ``--enable-lora``) or the name is already served, 503 when a worker
did not answer. An unload is accepted when the name is served (else 404): requests under it
that already run finish with it (their workers free the slot then), new ones get a 404 at once.
503 when a worker did not answer (the others have unloaded it; retrying is safe).
"""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web

from pdserve.gateway.app_state import GATEWAY_KEY, Gateway
from pdserve.gateway.body import read_json
from pdserve.gateway.errors import APIError, bad_request
from pdserve.shared.discovery.lora_admin import (
    MAX_LORA_NAME,
    LoadLoraAdapter,
    LoraAdapterAnswer,
    LoraCommand,
    UnloadLoraAdapter,
    ask_all,
)

LORA_TIMEOUT = 30.0  # seconds a worker has to answer (reading and checking the adapter)
REFUSED = ("invalid", "exists", "disabled")


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{name}' must be a non-empty string", param=name)
    return value.strip()


def _lora_name(gw: Gateway, body: dict[str, Any]) -> str:
    name = _field(body, "lora_name")
    if len(name) > MAX_LORA_NAME:
        raise bad_request(f"'lora_name' is longer than {MAX_LORA_NAME} characters", "lora_name")
    if name == gw.model.name:
        raise bad_request(f"'{name}' is the base model's name", param="lora_name")
    return name


async def _ask(gw: Gateway, command: LoraCommand) -> dict[str, LoraAdapterAnswer | str]:
    workers = sorted(w.worker_id for w in gw.workers.loads())
    if not workers:
        raise APIError(503, "no worker is alive", code="unavailable")
    return await ask_all(gw.bus, workers, command, LORA_TIMEOUT)


def _outcome(answers: dict[str, LoraAdapterAnswer | str]) -> dict[str, dict[str, str]]:
    return {
        worker: {"status": a.status, "error": a.error}
        if isinstance(a, LoraAdapterAnswer)
        else {"status": "no_answer", "error": a}
        for worker, a in answers.items()
    }


async def load_lora_adapter(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    body = await read_json(request)
    name, path = _lora_name(gw, body), _field(body, "lora_path")
    if name in gw.lora_adapters():
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    rid = f"lora-{secrets.token_hex(4)}"
    outcome = _outcome(await _ask(gw, LoadLoraAdapter(request_id=rid, name=name, path=path)))
    loaded = [w for w, o in outcome.items() if o["status"] == "ok"]
    if len(loaded) == len(outcome):
        gw.unloaded_loras.discard(name)
        for load in gw.workers.loads():  # routable now, not at the workers' next beat
            if load.worker_id in outcome and name not in load.lora_adapters:
                load.lora_adapters.append(name)
        return web.json_response({"object": "lora_adapter", "lora_name": name, "workers": outcome})
    if loaded:  # all or nothing: a fleet that serves an adapter on some workers only misroutes
        await ask_all(gw.bus, loaded, UnloadLoraAdapter(request_id=rid, name=name), LORA_TIMEOUT)
    refused = {w: o for w, o in outcome.items() if o["status"] in REFUSED}
    if refused:
        worker, why = sorted(refused.items())[0]
        raise bad_request(
            f"LoRA adapter '{name}' not loaded: {worker}: {why['error']}", "lora_path"
        )
    silent = ", ".join(sorted(w for w, o in outcome.items() if o["status"] == "no_answer"))
    raise APIError(503, f"LoRA adapter '{name}' not loaded: no answer from {silent}; retry")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    name = _lora_name(gw, await read_json(request))
    if name not in gw.advertised_loras():
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    rid = f"lora-{secrets.token_hex(4)}"
    outcome = _outcome(await _ask(gw, UnloadLoraAdapter(request_id=rid, name=name)))
    if any(o["status"] in ("ok", "deferred") for o in outcome.values()):
        gw.unloaded_loras.add(name)  # new requests under it: 404 from now on
    silent = sorted(w for w, o in outcome.items() if o["status"] == "no_answer")
    if silent:
        detail = ", ".join(silent)
        raise APIError(503, f"LoRA adapter '{name}' not unloaded on {detail}; retry")
    return web.json_response({"object": "lora_adapter", "lora_name": name, "workers": outcome})
