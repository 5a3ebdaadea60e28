"""Operator routes of the gateway (access class admin, ``gateway/access.py``: only
``--admin-api-key`` keys, closed when ``--api-key`` is set without one): ``POST
/reset_prefix_cache``, as vLLM's, for benchmarks and operators who need cold caches.

Every worker the registry knows is asked at once (``shared/discovery/cache_reset.py``); the
answer lists each one's outcome. The query takes vLLM's flags: ``reset_external=true`` empties
the KV offload tiers too (host memory, and the disk tier's files); ``reset_running_requests=true``
is refused (400): pdserve never drops a running request's KV, it answers busy instead. 200 when every worker forgot its cached blocks; 409 (OpenAI
error shape, ``code: "busy"``) when one still runs or holds a request, or did not answer, and
then the others' caches are reset all the same - try again once the fleet is idle.
"""

from __future__ import annotations

import secrets

from aiohttp import web

from pdserve.gateway.app_state import GATEWAY_KEY
from pdserve.gateway.errors import APIError
from pdserve.shared.discovery.cache_reset import PrefixCacheReset, reset_all

RESET_TIMEOUT = 5.0  # seconds a worker has to answer (a step's length, at most, on the engine)


def query_flag(request: web.Request, name: str) -> bool:
    """A true/false query parameter (absent: false), or a 400 naming it."""
    raw = request.query.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name} must be true or false, not {raw!r}", param=name)
    return value in ("true", "1")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    external = query_flag(request, "reset_external")
    if query_flag(request, "reset_running_requests"):
        raise APIError(
            400,
            "reset_running_requests is not supported: running requests keep "
            "their KV; retry when idle",
            param="reset_running_requests",
        )
    workers = sorted(w.worker_id for w in gw.workers.loads())
    answers = await reset_all(
        gw.bus, workers, f"reset-{secrets.token_hex(4)}", RESET_TIMEOUT, external
    )
    outcome = {
        worker: {"status": a.status, "blocks": a.blocks, "tier_blocks": a.tier_blocks}
        if isinstance(a, PrefixCacheReset)
        else {"status": "no_answer", "error": a}
        for worker, a in answers.items()
    }
    left = {w: o["status"] for w, o in outcome.items() if o["status"] != "ok"}
    if left:
        detail = ", ".join(f"{w}: {s}" for w, s in sorted(left.items()))
        raise APIError(
            409, f"prefix cache not reset everywhere ({detail}); retry when idle", code="busy"
        )
    return web.json_response({"object": "prefix_cache_reset", "workers": outcome})
