"""What a ``Bus`` keeps of its *replayable* messages - those whose receivers drop what they
already have (token batches: their items carry positions) - so that what a broken connection
lost can be sent again.

NATS core loses what a client writes into a connection that died before the client noticed (a
restarted server, a stopped process resumed), and what it publishes to a subscriber that is not
back yet. So a replayable message is remembered for ``REPLAY_SECONDS``; while the connection is
down it is held here (not in nats-py's reconnect buffer, which would send it before the
replay); after the reconnect the window goes out again, then what was held, in order, and both
stay remembered from then. A receiver that missed them (it reconnected later) asks, and gets the
window of its subject again (``for_subject``: once per ask, never what an earlier ask got).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

REPLAY_SECONDS = 5.0  # covers noticing a dead connection and a receiver reconnecting later
MAX_REPLAY_BYTES = 16 * 1024 * 1024  # past it the oldest go: a receiver sees those as lost

Entry = tuple[float, str, bytes, dict[str, str] | None]  # (when, subject, data, headers)


class ReplayWindow:
    def __init__(
        self,
        seconds: float = REPLAY_SECONDS,
        max_bytes: int = MAX_REPLAY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        self.clock = clock
        self._sent: deque[Entry] = deque()  # oldest first
        self._held: deque[Entry] = deque()
        self._bytes = 0  # of both
        self._asked: dict[str, float] = {}  # subject -> when its window was last replayed

    def sent(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        self._sent.append((self.clock(), subject, data, headers))
        self._bytes += len(data)
        self._trim()

    def hold(self, subject: str, data: bytes, headers: dict[str, str] | None) -> bool:
        """Keep a message published while the connection is down; False when full."""
        if self._bytes + len(data) > self.max_bytes:
            return False
        self._held.append((self.clock(), subject, data, headers))
        self._bytes += len(data)
        return True

    def window(self) -> list[Entry]:
        """After a reconnect: what may have gone into the dead connection, remembered anew."""
        now = self.clock()
        self._trim()
        self._sent = deque((now, s, d, h) for _, s, d, h in self._sent)
        return list(self._sent)

    def take_held(self) -> list[Entry]:
        """After a reconnect: what waited, oldest first, now remembered as sent."""
        held, self._held = list(self._held), deque()
        self._sent.extend(held)
        return held

    def for_subject(self, subject: str) -> list[Entry]:
        """What ``subject`` was sent within the window and not replayed to it yet."""
        self._trim()
        since = self._asked.get(subject, -1.0)
        self._asked[subject] = self.clock()
        return [e for e in self._sent if e[1] == subject and e[0] > since]

    def _trim(self) -> None:
        oldest = self.clock() - self.seconds
        while self._sent and (self._sent[0][0] < oldest or self._bytes > self.max_bytes):
            self._bytes -= len(self._sent.popleft()[2])
        for subject in [s for s, at in self._asked.items() if at < oldest]:
            del self._asked[subject]
