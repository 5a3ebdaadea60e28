"""Resetting the workers' prefix caches (``POST /reset_prefix_cache``, as vLLM's endpoint).

The gateway asks every worker it knows on its own admin subject (``{ns}.admin.{worker}``,
NATS request/reply); each forgets every cached block of its KV pool that no request holds and
answers with how many it forgot, or that it is busy (a block in use: a running request, a
leased prompt), in which case nothing changes - the caller tries again when it is idle. A reset
pool announces ``AllBlocksCleared`` on its KV event streams (NATS and vLLM's ZMQ format), so
routers drop what they knew of it. The offload tiers (host memory, disk) keep their blocks
unless the request says ``external`` (vLLM's ``reset_external``): then they are emptied too, the
disk tier's files deleted, and each block's removal is announced per tier.

These types live here, registered into ``pdserve.shared.bus.protocol``'s table, because only
the gateway's admin route and the workers speak them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.protocol import MESSAGE_TYPES, ProtocolError, decode_as, encode
from pdserve.shared.bus.subjects import Subjects, is_subject_token
from pdserve.shared.bus.wire_fields import bounded, count, ident, text
from pdserve.shared.discovery.worker_requests import ask_workers

log = logging.getLogger(__name__)

RESET_STATUSES = ("ok", "busy")


@dataclass
class ResetPrefixCache:
    TYPE: ClassVar[str] = "reset_prefix_cache"
    reset_id: str = ident()
    external: bool = bounded(default=False)  # the offload tiers' blocks too


@dataclass
class PrefixCacheReset:
    TYPE: ClassVar[str] = "prefix_cache_reset"
    reset_id: str = ident()
    worker_id: str = ident()
    status: str = text(max_len=8, choices=RESET_STATUSES)
    blocks: int = count(default=0)  # cached blocks of the pool forgotten
    tier_blocks: int = count(default=0)  # blocks of the offload tiers forgotten (external)


MESSAGE_TYPES[ResetPrefixCache.TYPE] = ResetPrefixCache
MESSAGE_TYPES[PrefixCacheReset.TYPE] = PrefixCacheReset


def admin_subject(subjects: Subjects, worker_id: str) -> str:
    if not is_subject_token(worker_id):
        raise ValueError(f"{worker_id!r} is not a valid subject token")
    return f"{subjects.namespace}.admin.{worker_id}"


async def answer_resets(
    bus: Bus, worker_id: str, reset: Callable[[bool], Awaitable[tuple[int, int] | None]]
) -> None:
    """Answer reset requests on this worker's admin subject: ``reset(external)`` gives the
    blocks forgotten (the pool's, the tiers'), or None when a block in use kept them all."""

    async def on_msg(raw: Any) -> None:
        try:
            msg = decode_as(raw.data, ResetPrefixCache, max_bytes=bus.max_bytes)
        except ProtocolError as exc:
            bus.count_rejected(raw.subject, exc)
            return
        if not raw.reply:
            return
        try:
            forgot = await reset(msg.external)
            status = "busy" if forgot is None else "ok"
            pool, tiers = forgot or (0, 0)
            log.info(
                "prefix cache reset (%s): %s, %d block(s), %d of the tiers",
                msg.reset_id,
                status,
                pool,
                tiers,
            )
            await raw.respond(
                encode(
                    PrefixCacheReset(
                        reset_id=msg.reset_id,
                        worker_id=worker_id,
                        status=status,
                        blocks=pool,
                        tier_blocks=tiers,
                    )
                )
            )
        except Exception:
            log.exception("prefix cache reset %s failed", msg.reset_id)

    await bus.nc.subscribe(admin_subject(bus.subjects, worker_id), cb=on_msg)


async def reset_all(
    bus: Bus, worker_ids: list[str], reset_id: str, timeout: float, external: bool = False
) -> dict[str, PrefixCacheReset | str]:
    """Ask every worker at once (``external``: to empty its tiers too); per worker its
    answer, or why there is none."""
    return await ask_workers(
        bus,
        worker_ids,
        lambda worker_id: admin_subject(bus.subjects, worker_id),
        encode(ResetPrefixCache(reset_id=reset_id, external=external)),
        PrefixCacheReset,
        timeout,
    )
