"""One NATS request to each of several workers at once, each on its own subject, and each answer
decoded as the expected type: how the gateway's admin routes reach the fleet (prefix-cache resets,
``cache_reset.py``; LoRA loads and unloads, ``lora_admin.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.protocol import decode_as

Answer = TypeVar("Answer")


async def ask_workers(
    bus: Bus,
    worker_ids: list[str],
    subject_of: Callable[[str], str],
    payload: bytes,
    answer_type: type[Answer],
    timeout: float,
) -> dict[str, Answer | str]:
    """Send ``payload`` to every worker's ``subject_of(worker_id)`` at once; per worker its
    answer, or why there is none (no responders, a timeout, a malformed answer)."""

    async def one(worker_id: str) -> Answer | str:
        try:
            if bus.nc is None:
                raise RuntimeError("the bus is not connected")
            raw = await bus.nc.request(subject_of(worker_id), payload, timeout=timeout)
            return decode_as(raw.data, answer_type, max_bytes=bus.max_bytes)
        except Exception as exc:
            return f"no answer: {type(exc).__name__}"

    answers = await asyncio.gather(*map(one, worker_ids))
    return dict(zip(worker_ids, answers, strict=True))
