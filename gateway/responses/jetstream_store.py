"""Stored responses in a NATS JetStream KV bucket, ``<namespace>_responses``, on the gateway's own
NATS connection.

The bucket keeps one value per response id (history 1) for ``--response-store-ttl`` seconds (the
stream's max age; 0 = until deleted) in ``--response-store-replicas`` copies (in a cluster, on
that many nodes). Every gateway creates it the same way; one started with other settings updates
the bucket to its own (the last one started wins), so changing the TTL needs no manual step.

Opening never stops the gateway: a NATS without JetStream (no responder on ``$JS.API``) is said
in one warning line and the store stays unavailable (``problem``, permanent); a JetStream that
is not ready yet (a cluster electing its leader) or a bucket that cannot be made as asked (more
replicas than nodes) is a warning too, and the gateway tries again every ``RETRY_SECONDS``
meanwhile, so a cluster that comes up late is used once it is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from nats.errors import Error as NatsError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from pdserve.gateway.responses.store import ResponseStore, StoredResponse, StoreFailed
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.roles import responses_bucket

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0  # between tries to open a store that is not ready
API_TIMEOUT = 5.0  # seconds a JetStream request may take
STREAM_IN_USE = 10058  # JetStream: a stream by that name exists with another configuration
DUPLICATE_WINDOW = 120.0  # nats-py's default for KV buckets, seconds


class NoJetStream(Exception):
    pass


def bucket_name(namespace: str) -> str:
    """The KV bucket of a namespace (the gateway's bus permissions name it too)."""
    return responses_bucket(namespace)


class JetStreamResponseStore(ResponseStore):
    def __init__(self, bus: Bus, *, ttl: float, replicas: int) -> None:
        self.bus = bus
        self.ttl = ttl
        self.replicas = replicas
        self.bucket = bucket_name(bus.config.namespace)
        self._kv: KeyValue | None = None
        self._retry: asyncio.Task[None] | None = None

    async def open(self) -> None:
        if await self._try_open():
            return
        if not self.permanent:
            self._retry = asyncio.ensure_future(self._keep_trying())

    async def _try_open(self) -> bool:
        """One try; True when the bucket is ready or can never be (no JetStream)."""
        try:
            self._kv = await self._bucket()
        except NoJetStream as exc:
            self.problem, self.permanent = str(exc), True
            log.warning("%s", exc)
            return True
        except (NatsError, OSError, asyncio.TimeoutError) as exc:
            if self.problem is None or self._retry is None:  # said once, not every retry
                log.warning(
                    "responses cannot be stored yet (%s); trying again every %.0f s",
                    _said(exc),
                    RETRY_SECONDS,
                )
            self.problem = f"JetStream's KV bucket {self.bucket} is not ready: {_said(exc)}"
            return False
        self.problem, self.permanent = None, False
        log.info(
            "responses stored in JetStream KV bucket %s (ttl %s, %d replica%s)",
            self.bucket,
            f"{self.ttl:.0f} s" if self.ttl else "none",
            self.replicas,
            "" if self.replicas == 1 else "s",
        )
        return True

    async def _keep_trying(self) -> None:
        while True:
            await asyncio.sleep(RETRY_SECONDS)
            if await self._try_open():
                return

    async def _bucket(self) -> KeyValue:
        nc = self.bus.nc
        if nc is None or not hasattr(nc, "jetstream"):
            raise NoJetStream(_NO_JETSTREAM.format(url=self.bus.config.nats_url))
        js = nc.jetstream(timeout=API_TIMEOUT)
        try:
            await js.account_info()
        except ServiceUnavailableError as exc:
            if exc.err_code is None:  # no responder at all: this NATS runs without JetStream
                raise NoJetStream(_NO_JETSTREAM.format(url=self.bus.config.nats_url)) from None
            raise
        config = KeyValueConfig(
            bucket=self.bucket,
            description="pdserve: stored /v1/responses answers",
            history=1,
            ttl=self.ttl or None,
            replicas=self.replicas,
            storage=StorageType.FILE,
        )
        try:
            return await js.create_key_value(config)
        except BadRequestError as exc:
            if exc.err_code != STREAM_IN_USE:
                raise
        # made before with other settings (TTL, replicas): this gateway's win
        info = await js.stream_info(f"KV_{self.bucket}")
        stream = info.config
        stream.max_age = self.ttl or None
        stream.num_replicas = self.replicas
        stream.duplicate_window = min(DUPLICATE_WINDOW, self.ttl or DUPLICATE_WINDOW)
        await js.update_stream(stream)
        log.info("updated the response store's bucket %s to this gateway's settings", self.bucket)
        return await js.key_value(self.bucket)

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry

    def _ready_kv(self) -> KeyValue:
        if self._kv is None or self.problem is not None:
            raise StoreFailed(self.problem or "not opened")
        return self._kv

    async def get(self, response_id: str) -> StoredResponse | None:
        kv = self._ready_kv()
        try:
            entry = await kv.get(response_id)
        except KeyNotFoundError:  # never stored, deleted, or expired
            return None
        except (NatsError, OSError, asyncio.TimeoutError) as exc:
            raise StoreFailed(_said(exc)) from exc
        if entry.value is None:
            return None
        try:
            return StoredResponse.decode(entry.value)
        except ValueError as exc:
            log.warning(
                "stored response %s cannot be read (%s): treated as absent", response_id, exc
            )
            return None

    async def put(self, response_id: str, record: StoredResponse) -> None:
        kv = self._ready_kv()
        try:
            await kv.put(response_id, record.encode())
        except (NatsError, OSError, asyncio.TimeoutError) as exc:
            raise StoreFailed(_said(exc)) from exc

    async def delete(self, response_id: str) -> bool:
        if await self.get(response_id) is None:
            return False
        kv = self._ready_kv()
        try:
            await kv.purge(response_id)  # the value goes, not only hidden behind a marker
        except (NatsError, OSError, asyncio.TimeoutError) as exc:
            raise StoreFailed(_said(exc)) from exc
        return True


_NO_JETSTREAM = (
    "NATS at {url} has no JetStream: /v1/responses answers without storing, and store: true, "
    "previous_response_id and GET/DELETE /v1/responses/{{id}} get a 400 (run nats-server "
    "with -js to store responses)"
)


def _said(exc: Any) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
