"""Every NATS subject pdserve uses, under one namespace (the flow is in shared/bus/protocol.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ID_CHARS = 128  # worker, request and gateway ids

# Worker ids, request ids and gateway ids appear inside NATS subjects, so they must be one
# subject token: no dots, no wildcards, no whitespace.
TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-:]+$")
# A full subject: dot-separated tokens, no wildcards (we only ever publish to it).
SUBJECT_RE = re.compile(r"^[A-Za-z0-9_\-:]+(\.[A-Za-z0-9_\-:]+)*$")


def is_subject_token(text: str) -> bool:
    return bool(TOKEN_RE.match(text)) and len(text) <= MAX_ID_CHARS


@dataclass(frozen=True)
class Subjects:
    """Every NATS subject pdserve uses, under one namespace."""

    namespace: str = "pdserve"

    def __post_init__(self) -> None:
        if not SUBJECT_RE.match(self.namespace):
            raise ValueError(f"invalid namespace {self.namespace!r}")

    def _join(self, *parts: str) -> str:
        for part in parts:
            if not is_subject_token(part):
                raise ValueError(f"{part!r} is not a valid subject token")
        return ".".join((self.namespace, *parts))

    def prefill(self, worker_id: str) -> str:
        return self._join("prefill", worker_id)

    def decode(self, worker_id: str) -> str:
        return self._join("decode", worker_id)

    def lease(self, worker_id: str) -> str:
        return self._join("lease", worker_id)

    @property
    def cancel(self) -> str:
        return self._join("cancel")

    def load(self, role: str, worker_id: str) -> str:
        return self._join("load", role, worker_id)

    def loads_of(self, role: str) -> str:
        return self._join("load", role) + ".*"

    @property
    def all_loads(self) -> str:
        return self._join("load") + ".>"

    def kv(self, worker_id: str) -> str:
        return self._join("kv", worker_id)

    @property
    def all_kv(self) -> str:
        return self._join("kv") + ".>"

    def ping(self, worker_id: str) -> str:
        return self._join("ping", worker_id)

    def gateway(self, gateway_id: str) -> str:
        return self._join("gw", gateway_id)

    @property
    def gateway_prefix(self) -> str:
        """Workers publish replies only under this prefix (reply_to is checked against it)."""
        return f"{self.namespace}.gw."

    def is_gateway_inbox(self, reply_to: str) -> bool:
        """Whether a worker may reply to ``reply_to``: replies go only to gateway inboxes, so a
        message cannot make a worker publish elsewhere."""
        return reply_to.startswith(self.gateway_prefix)
