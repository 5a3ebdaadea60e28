"""A decode worker's KV endpoints to the prefill workers it hears of: connected when a prefill
worker first shows up, so the first pull does not pay for the endpoint (tens of ms), and let go
when the worker says it left."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.kv.transfer import KVClient

log = logging.getLogger(__name__)


class PrefillPeers:
    """Prefill worker id -> the KV address connected to, kept from their loads."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task]) -> None:
        self.addresses: dict[str, str] = {}
        self._spawn = spawn

    def on_load(self, client: KVClient, load: WorkerLoad | WorkerGone) -> None:
        """A worker rejoining after a NATS reconnect keeps its endpoint: aborting ours would also
        fail its twin on the prefill side, which that worker may be about to send a pull's
        blocks on (UCX pairs the two), and every pull until it noticed would fail."""
        if isinstance(load, WorkerGone):
            if load.rejoining:
                return
            address = self.addresses.pop(load.worker_id, None)
            if address is not None:
                client.disconnect(address)
            return
        if load.ucx_address and self.addresses.get(load.worker_id) != load.ucx_address:
            self.addresses[load.worker_id] = load.ucx_address
            self._spawn(self._connect(client, load.worker_id, load.ucx_address))

    async def _connect(self, client: KVClient, worker_id: str, address: str) -> None:
        try:
            await client.connect(address)
        except Exception as exc:  # the pull will try again and report properly
            log.info("could not pre-connect to %s: %r", worker_id, exc)
