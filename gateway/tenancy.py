"""What keeps tenants of one fleet apart at the gateway: vLLM's ``cache_salt`` and ``priority``
request fields, on every generation endpoint (completions, chat, Messages, Responses).

``cache_salt`` (a non-empty string): requests share cached prompt blocks only when their salts
match. The salt names the root of the request's chain of block hashes (``shared/kv/layout.py``),
so the pool's prefix cache on both sides of P/D, KV events, the router's prefix index, the offload
tiers and migration all keep salts apart. Timing then tells a tenant nothing of another's
prompts (CVE-2025-46570). With API keys configured the gateway salts by the presented key as
well (``--prefix-cache-scope key``, the default): two keys never share cached blocks, whatever
their clients send; ``global`` salts by the client's ``cache_salt`` alone (an operator who wants
keys to share a system prompt's KV). The workers get a digest, never the key or the salt.

``priority`` (an integer, lower first; default 0): honoured under ``--scheduling-policy priority``
by every queue a request waits in (the workers' admission queues, the decode side's pulls and its
preemption victims: ``services/engine/wait_queue.py``). Under ``fcfs`` (the default) a non-zero
priority is a 400, as vLLM answers it.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from pydantic import BeforeValidator, Field

from pdserve.gateway.errors import bad_request
from pdserve.gateway.sampling_fields import whole_float_as_int
from pdserve.gateway.schema_base import StrictModel
from pdserve.shared.sampling import MAX_PRIORITY

MAX_CLIENT_SALT_CHARS = 4096  # what a client may send; the workers get a fixed-size digest

CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CLIENT_SALT_CHARS)]
# (written out, not sampling_fields.integer(): a type pyright can read)
Priority = Annotated[
    int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY), BeforeValidator(whole_float_as_int)
]


class TenancyFields(StrictModel):
    """vLLM's request fields every generation endpoint takes."""

    cache_salt: CacheSalt | None = Field(
        None,
        description="vLLM's: requests share cached prompt blocks only with requests of the "
        "same salt (with API keys configured, of the same key too: --prefix-cache-scope)",
    )
    priority: Priority | None = Field(
        None,
        description="vLLM's: lower is served first under --scheduling-policy priority; "
        "must be 0 (or absent) under fcfs",
    )


def request_salt(scope: str, key: str, client_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed under: a digest of the presented API ``key``
    (``scope`` "key"; '' when keys are off) and the client's ``cache_salt``; None when neither
    applies (the unsalted chain every keyless, saltless request shares)."""
    key = "" if scope == "global" else key  # any other value: the safe one
    if not key and client_salt is None:
        return None
    h = hashlib.blake2b(digest_size=16, person=b"pdserve-tenant")
    # length-prefixed: no (key, salt) pair can spell another's
    for part in (key, client_salt or ""):
        raw = part.encode()
        h.update(len(raw).to_bytes(8, "little") + raw)
    h.update(b"\x01" if client_salt is not None else b"\x00")
    return h.hexdigest()


def check_priority(policy: str, priority: int) -> None:
    """A non-zero priority needs ``--scheduling-policy priority`` (vLLM refuses it too)."""
    if priority and policy != "priority":
        raise bad_request(
            f"priority {priority} needs --scheduling-policy priority (this server schedules "
            f"{policy}); send 0 or leave it out",
            "priority",
        )
