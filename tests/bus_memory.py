"""An in-process message bus with the NATS bus's interface, for fast tests below the real bus.

``MemoryNetwork`` plays the NATS server: subjects with ``*`` and ``>`` wildcards, queue groups
(one member of each group gets a message), request-reply with an answer of "no responders" at
once when nobody listens, and a payload limit. ``MemoryBus`` is a ``pdserve.shared.bus.connection.Bus`` whose
connection (``bus.nc``) is a ``MemoryClient`` on such a network instead of nats-py, so
``publish``/``subscribe``/``close``/``on_reconnect``, the size limit, the stats and the
schema check are the real ``Bus`` code: every message is still ``protocol.encode``-d on the way
out and ``decode_as``-checked on the way in, and a malformed one is rejected and counted exactly
as on NATS. Code that talks to ``bus.nc`` directly (pings, probes: ``subscribe(cb=...)``,
``request``, ``msg.respond``) gets the same calls.

Delivery is asynchronous and ordered per subscription, as with nats-py: each subscription has a
queue and one task that runs its callback for one message at a time. Nothing polls.

    net = MemoryNetwork()
    gw_bus = MemoryBus(BusConfig(namespace="t"), "gw", network=net)
    await gw_bus.connect()

``await bus.nc.crash()`` drops a connection without a word (as kill -9 does), and
``await bus.nc.reconnect()`` runs the bus's reconnect callbacks as a NATS reconnect would.
NATS micro services are not emulated: ``register_micro_service`` fails at once on this bus (the
workers treat that registration as optional).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from pdserve.shared.bus.connection import Bus
from pdserve.shared.config import BusConfig

log = logging.getLogger("pdserve.bus.memory")

DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024  # the server's limit; each Bus enforces its own too

Callback = Callable[["RawMessage"], Awaitable[None]]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return i == len(want) - 1 and len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


@dataclass
class RawMessage:
    """What a raw subscriber sees: nats-py's ``Msg`` fields that pdserve uses."""

    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None
    _client: MemoryClient | None = field(default=None, repr=False)

    async def respond(self, data: bytes) -> None:
        if not self.reply:
            raise ValueError("no reply subject to respond to")
        if self._client is None:
            raise ConnectionError("not connected")
        await self._client.publish(self.reply, data)


class MemorySubscription:
    def __init__(self, client: MemoryClient, subject: str, queue: str, cb: Callback) -> None:
        self.client = client
        self.subject = subject
        self.queue = queue
        self._cb = cb
        self._pending: asyncio.Queue[RawMessage] = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name=f"memsub:{subject}")
        self.delivered = 0

    def deliver(self, msg: RawMessage) -> None:
        self._pending.put_nowait(msg)

    async def _run(self) -> None:
        while True:
            msg = await self._pending.get()
            self.delivered += 1
            try:
                await self._cb(msg)
            except Exception:  # as nats-py: a failing callback does not end the subscription
                log.exception("subscription callback for %s failed", msg.subject)

    async def unsubscribe(self) -> None:
        self.client.network._remove(self)
        with contextlib.suppress(ValueError):
            self.client._subs.remove(self)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def drain(self) -> None:
        await self.unsubscribe()


class MemoryNetwork:
    """The "server": routes published bytes to matching subscriptions."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self._subs: list[MemorySubscription] = []
        self._turn = itertools.count()  # queue groups take turns
        self.published = 0

    def _add(self, sub: MemorySubscription) -> None:
        self._subs.append(sub)

    def _remove(self, sub: MemorySubscription) -> None:
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)

    def route(self, client: MemoryClient, subject: str, data: bytes, reply: str, headers) -> int:
        """Deliver to every plain subscriber and one member per queue group; how many got it."""
        self.published += 1
        plain: list[MemorySubscription] = []
        groups: dict[str, list[MemorySubscription]] = {}
        for sub in self._subs:
            if subject_matches(sub.subject, subject):
                if sub.queue:
                    groups.setdefault(sub.queue, []).append(sub)
                else:
                    plain.append(sub)
        turn = next(self._turn)
        targets = plain + [members[turn % len(members)] for members in groups.values()]
        for sub in targets:
            sub.deliver(
                RawMessage(subject, data, reply, dict(headers) if headers else None, sub.client)
            )
        return len(targets)

    def subscribers(self, subject: str) -> int:
        """How many subscriptions a message on ``subject`` would match (for tests)."""
        return sum(subject_matches(s.subject, subject) for s in self._subs)


class MemoryClient:
    """The part of nats-py's ``Client`` that pdserve uses, on a ``MemoryNetwork``."""

    def __init__(self, network: MemoryNetwork, name: str, bus: Bus | None = None) -> None:
        self.network = network
        self.name = name
        self._bus = bus
        self._subs: list[MemorySubscription] = []
        self._closed = False
        self.connected_url = None

    @property
    def is_connected(self) -> bool:
        return not self._closed

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionError("connection closed")

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callback | None = None, **_: object
    ) -> MemorySubscription:
        self._check_open()
        if cb is None:
            raise ValueError("the in-memory bus delivers to callbacks only")
        sub = MemorySubscription(self, subject, queue, cb)
        self._subs.append(sub)
        self.network._add(sub)
        return sub

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers=None
    ) -> None:
        self._check_open()
        if len(payload) > self.network.max_payload:
            raise MaxPayloadError
        self.network.route(self, subject, payload, reply, headers)

    async def request(
        self, subject: str, payload: bytes = b"", timeout: float = 0.5, headers=None
    ) -> RawMessage:
        self._check_open()
        if len(payload) > self.network.max_payload:
            raise MaxPayloadError
        answer: asyncio.Future[RawMessage] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: RawMessage) -> None:
            if not answer.done():
                answer.set_result(msg)

        inbox = await self.subscribe(self.new_inbox(), cb=on_reply)
        try:
            if self.network.route(self, subject, payload, inbox.subject, headers) == 0:
                raise NoRespondersError
            try:
                return await asyncio.wait_for(answer, timeout)
            except asyncio.TimeoutError:
                raise NatsTimeoutError from None
        finally:
            await inbox.unsubscribe()

    def new_inbox(self) -> str:
        return f"_INBOX.{secrets.token_hex(8)}"

    async def flush(self, timeout: float = 2.0) -> None:
        """Everything published is already queued at its subscribers; let them run once."""
        self._check_open()
        await asyncio.sleep(0)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            await sub.unsubscribe()

    async def drain(self) -> None:
        await self.close()

    async def crash(self) -> None:
        """The process died: its subscriptions vanish, nothing more is said (no WorkerGone)."""
        await self.close()

    async def reconnect(self) -> None:
        """Run the owning bus's reconnect callbacks, as after a NATS reconnect."""
        if self._bus is not None:
            await self._bus._reconnected_cb()


class MemoryBus(Bus):
    """``pdserve.shared.bus.connection.Bus`` on a ``MemoryNetwork`` instead of a NATS server.

    Without ``network`` the bus gets a network of its own (a one-process test); give several
    buses the same network to let them talk.
    """

    def __init__(
        self,
        config: BusConfig | None = None,
        name: str = "memory",
        network: MemoryNetwork | None = None,
    ) -> None:
        super().__init__(config or BusConfig(), name)
        self.network = network if network is not None else MemoryNetwork()

    async def connect(self, timeout: float = 30.0) -> None:
        self._closing = False
        self.nc = MemoryClient(self.network, self.name, self)  # type: ignore[assignment]
