"""The NATS message bus: one connection per process, protocol messages in and out.

``Bus`` wraps nats-py with what every pdserve process needs: reconnects that never give up,
authentication and TLS from ``BusConfig``, namespaced subjects (``bus.subjects``), headers for
trace context, and a hard filter on input - every received message is size-limited and fully
schema-checked by ``pdserve.shared.bus.protocol.decode`` before a handler sees it. Bad messages are counted
and logged (rate-limited), never raised into the subscription loop. What is published while the
connection is down is dropped, except replayable messages (``shared/bus/replay.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import AuthorizationError, NoRespondersError

from pdserve.shared.bus.protocol import Message, ProtocolError, decode_as, encode
from pdserve.shared.bus.rejects import reject_reason, subject_kind
from pdserve.shared.bus.replay import ReplayWindow
from pdserve.shared.bus.subjects import Subjects
from pdserve.shared.config import BusConfig

log = logging.getLogger(__name__)

Handler = Callable[[Any, dict[str, str]], Awaitable[None]]


@dataclass
class BusStats:
    received: int = 0
    rejected: int = 0  # oversized or failed the schema check
    # the same, by (subject kind, reason): pdserve_bus_rejected_messages_total (rejects.py)
    rejected_by: dict[tuple[str, str], int] = field(default_factory=dict)
    handler_errors: int = 0
    reconnects: int = 0
    dropped: int = 0  # published while the connection was down (see Bus.publish)
    last_reject_log: float = field(default=0.0, repr=False)


def tls_context(config: BusConfig) -> ssl.SSLContext | None:
    """A TLS context when a CA or client certificate is configured; None leaves TLS to the URL
    scheme (``tls://`` uses the system trust store)."""
    if not (config.nats_tls_ca or config.nats_tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.nats_tls_ca)
    if config.nats_tls_cert:
        ctx.load_cert_chain(config.nats_tls_cert, config.nats_tls_key)
    return ctx


def nats_servers(nats_url: str) -> list[str]:
    """The server URLs of ``--nats-url``: comma and/or space separated, in the given order; a
    bare ``host:port`` gets the ``nats://`` scheme."""
    parts = [p for p in nats_url.replace(",", " ").split() if p]
    return [p if "://" in p else f"nats://{p}" for p in parts]


def connect_options(config: BusConfig, name: str) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (auth, TLS, reconnect policy).

    Several servers (nodes of one NATS cluster) are tried in the order given, first connect
    and every reconnect alike: list this host's own node first and the others for failover.
    nats-py would shuffle them otherwise, sending a process to a remote node while its local
    one is up. Nodes the cluster announces that are not listed are added after them.
    """
    servers = nats_servers(config.nats_url)
    if not servers:
        raise ValueError(f"no NATS server in --nats-url {config.nats_url!r}")
    opts: dict[str, Any] = {
        "servers": servers,
        "dont_randomize": True,
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,  # a restarted NATS must never strand a worker
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
    }
    if config.nats_token:
        opts["token"] = config.nats_token
    if config.nats_user:
        opts["user"] = config.nats_user
        opts["password"] = config.nats_password or ""
    if config.nats_creds:
        opts["user_credentials"] = config.nats_creds
    ctx = tls_context(config)
    if ctx is not None:
        opts["tls"] = ctx
    return opts


class Bus:
    def __init__(self, config: BusConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.subjects = Subjects(config.namespace)
        self.max_bytes = config.max_message_bytes
        self.stats = BusStats()
        self.nc: Client | None = None
        self._subs: list[Subscription] = []
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._closing = False
        # From a lost connection until our reconnect callbacks have run: publishes are dropped
        self._suspended = False
        self._auth_rejected: asyncio.Future | None = None
        self._replay = ReplayWindow()  # replayable messages (shared/bus/replay.py)

    # -- connection -------------------------------------------------------------------------

    async def connect(self, timeout: float = 30.0) -> None:
        """Connect, retrying until ``timeout``: in compose the bus may start after us."""
        opts = connect_options(self.config, self.name)
        opts.update(
            error_cb=self._error_cb,
            disconnected_cb=self._disconnected_cb,
            reconnected_cb=self._reconnected_cb,
        )
        # With unlimited reconnects nats-py keeps trying the first connect forever too (in
        # compose the bus may come up after us), so the overall wait is bounded here - but
        # rejected credentials will not fix themselves: those fail at once.
        self._auth_rejected = asyncio.get_running_loop().create_future()
        connecting = asyncio.ensure_future(nats.connect(**opts))
        try:
            done, _ = await asyncio.wait(
                {connecting, self._auth_rejected}, timeout=timeout, return_when="FIRST_COMPLETED"
            )
            if connecting not in done:
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await connecting
                if self._auth_rejected.done():
                    raise PermissionError("NATS rejected our credentials (authorization violation)")
                raise asyncio.TimeoutError(f"no NATS server answered within {timeout:.0f}s")
            self.nc = connecting.result()
        except Exception as exc:
            raise ConnectionError(
                f"cannot connect to NATS at {self.config.nats_url}: {exc!r}"
            ) from exc
        log.info("connected to NATS %s as %s", _url(self.nc), self.name)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after every reconnect (e.g. republish state at once)."""
        self._on_reconnect.append(callback)

    async def _error_cb(self, exc: Exception) -> None:
        log.warning("NATS error: %s", exc)
        rejected = (
            isinstance(exc, AuthorizationError) or "authorization violation" in str(exc).lower()
        )
        if rejected and self._auth_rejected is not None and not self._auth_rejected.done():
            self._auth_rejected.set_result(True)

    async def _disconnected_cb(self) -> None:
        self._suspended = True
        self._forget_pending()
        if not self._closing:
            log.warning("disconnected from NATS: dropping what we publish until we reconnect")

    async def _reconnected_cb(self) -> None:
        self.stats.reconnects += 1
        log.info("reconnected to NATS %s", _url(self.nc))
        # What may have gone into the dead connection, then what waited for this one, in order;
        # then publishing again, callbacks first: nothing else runs before the first publishes.
        for entry in self._replay.window():
            await self._resend(entry)
        while held := self._replay.take_held():  # (a publish while we resend is held too)
            for entry in held:
                await self._resend(entry)
        self._suspended = False
        for callback in self._on_reconnect:
            try:
                await callback()
            except Exception:
                log.exception("reconnect callback failed")

    async def close(self) -> None:
        """Flush what we published and close. Safe to call twice."""
        self._closing = True
        nc, self.nc = self.nc, None
        if nc is None or nc.is_closed:
            return
        try:
            await asyncio.wait_for(nc.flush(), 2.0)
        except Exception:
            pass
        try:
            await asyncio.wait_for(nc.close(), 5.0)
        except Exception:
            log.debug("error while closing NATS", exc_info=True)

    # -- messages ---------------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        msg: Message,
        headers: dict[str, str] | None = None,
        *,
        replayable: bool = False,
    ) -> None:
        """Send ``msg``; while the connection is down it is dropped (``_drop``). A
        ``replayable`` one (its receiver drops what it already has: token positions) is held
        instead, and sent again after a reconnect or when asked (``replay``)."""
        if self.nc is None:
            raise ConnectionError("bus is not connected")
        data = encode(msg)
        if len(data) > self.max_bytes:
            raise ProtocolError(f"{msg.TYPE} of {len(data)} bytes exceeds {self.max_bytes}")
        headers = headers or None
        if self._suspended or getattr(self.nc, "is_reconnecting", False):
            if not (replayable and self._replay.hold(subject, data, headers)):
                self._drop(subject, msg)
            return
        if replayable:
            self._replay.sent(subject, data, headers)
        await self.nc.publish(subject, data, headers=headers)

    async def replay(self, subject: str) -> int:
        """Send ``subject`` again the replayable messages it was sent lately and not replayed
        yet (a receiver back from a reconnect asks). Returns how many."""
        if self._suspended or getattr(self.nc, "is_reconnecting", False):
            return 0
        entries = self._replay.for_subject(subject)
        for entry in entries:
            await self._resend(entry)
        return len(entries)

    async def _resend(self, entry: tuple[float, str, bytes, dict[str, str] | None]) -> None:
        _, subject, data, headers = entry
        try:
            await self.nc.publish(subject, data, headers=headers)
        except Exception as exc:  # broken again: what is lost shows as a gap
            log.debug("could not send %s again: %s", subject, exc)

    async def flush(self, timeout: float = 2.0) -> None:
        if self.nc is not None:
            await self.nc.flush(timeout=timeout)

    async def answers(self, timeout: float) -> bool:
        """Whether our server answers a request within ``timeout``: one to a subject nobody
        listens on (a ping of a worker id no worker has) comes back at once as "no responders".
        A link that went down shows here at once, while nats-py notices only after
        ``max_outstanding_pings`` of its own (``connect_options``), and until then
        ``connected`` still says yes. Not ``flush``: nats-py (2.x) breaks its connection on a
        PONG that comes after a flush timed out. A ping subject, because a gateway's NATS user
        may publish pings and nothing in ``_INBOX`` (``roles.py``)."""
        if not self.connected:
            return False
        assert self.nc is not None
        try:
            await self.nc.request(self.subjects.ping(f"_probe-{self.name}"), b"", timeout=timeout)
        except NoRespondersError:
            return True
        except Exception:  # nats-py's timeout, or the connection broke meanwhile
            return False
        return True

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        accept: tuple[type, ...],
        queue: str | None = None,
    ) -> Subscription:
        """Deliver messages of the ``accept`` types on ``subject`` to ``handler(msg, headers)``.

        Messages are handled one at a time per subscription, in arrival order; a handler that
        must not block others should hand work off (e.g. to a queue) and return.
        """
        if self.nc is None:
            raise ConnectionError("bus is not connected")

        async def on_msg(raw: Msg) -> None:
            self.stats.received += 1
            try:
                msg = decode_as(raw.data, *accept, max_bytes=self.max_bytes)
            except ProtocolError as exc:
                self.count_rejected(raw.subject, exc)
                return
            try:
                await handler(msg, dict(raw.headers or {}))
            except Exception:
                self.stats.handler_errors += 1
                log.exception("handler for %s failed on %s", raw.subject, msg.TYPE)

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_msg)
        self._subs.append(sub)
        return sub

    def _forget_pending(self) -> None:
        """Empty nats-py's write buffer when the connection is lost: what it holds was published
        after what went into the dead socket, and nats-py would flush it after the reconnect,
        behind that loss, as a gap the receiver cannot see (the same reason ``_drop`` keeps new
        publishes out of it). Subscriptions are re-sent from nats-py's own table, replayable
        messages from ours. (``_pending`` is nats-py's, 2.x: there is no public way.)"""
        nc = self.nc
        pending = getattr(nc, "_pending", None) if nc is not None else None
        if pending:
            self.stats.dropped += len(pending)  # a command each: publishes, and maybe a PING
            nc._pending = []
            nc._pending_data_size = 0

    def _drop(self, subject: str, msg: Message) -> None:
        """A message published while the connection is down goes nowhere, never into nats-py's
        reconnect buffer: what we wrote into the dead connection is already lost, so whatever
        we sent after it would reach the other side behind a gap it cannot see. Dropped, the
        loss is a clean tail, which the reconnect callbacks repair (the gateway re-sends its
        requests, a worker announces its reconnect). Replayable messages are the exception:
        their receivers drop what they already have, so they are held and sent again."""
        self._suspended = True
        self.stats.dropped += 1
        log.debug("dropped %s on %s while disconnected", msg.TYPE, subject)

    def count_rejected(self, subject: str, exc: Exception) -> None:
        """Count (and, rate-limited, log) a message dropped by a decoder: ``Bus.subscribe``'s,
        and those of handlers that subscribe on ``nc`` directly (request/reply)."""
        self.stats.rejected += 1
        key = (subject_kind(subject, self.subjects.namespace), reject_reason(exc))
        self.stats.rejected_by[key] = self.stats.rejected_by.get(key, 0) + 1
        now = time.monotonic()
        if now - self.stats.last_reject_log > 5.0:  # a flood of junk must not flood the log
            self.stats.last_reject_log = now
            log.warning("rejected message on %s (%d so far): %s", subject, self.stats.rejected, exc)


def _url(nc: Client | None) -> str:
    url = nc.connected_url if nc is not None else None
    return url.netloc if url is not None else "?"
