"""Loading and unloading LoRA adapters at run time (``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, vLLM's endpoints) on every worker of the fleet.

The gateway asks each worker it knows on the worker's LoRA admin subject
(``{ns}.admin.{worker}.lora``, NATS request/reply; its own subject, so that the prefix-cache
resets of ``cache_reset.py`` keep theirs). A load is checked by the worker (the PEFT directory
readable, its rank within ``--max-lora-rank``, only projections the engine adapts) before it
serves the name; an unload stops new requests at once and frees the adapter's slot when the
requests under it end (``deferred``). Each answer carries the worker's status and reason:

- ``ok``: loaded, or unloaded at once; ``deferred``: unloaded once its requests end;
- ``exists``: the name is already served (or still being unloaded); ``unknown``: unload of a
  name it does not serve; ``invalid``: the adapter was refused (``error`` says why);
  ``disabled``: the worker has no adapter slots (started without ``--enable-lora``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.protocol import MESSAGE_TYPES, ProtocolError, decode_as, encode
from pdserve.shared.bus.subjects import Subjects, is_subject_token
from pdserve.shared.bus.wire_fields import bounded, ident, text
from pdserve.shared.discovery.worker_requests import ask_workers

log = logging.getLogger(__name__)

LORA_STATUSES = ("ok", "deferred", "exists", "unknown", "invalid", "disabled")
MAX_LORA_NAME = 256


@dataclass
class LoadLoraAdapter:
    TYPE: ClassVar[str] = "load_lora_adapter"
    request_id: str = ident()
    name: str = text(max_len=MAX_LORA_NAME)
    path: str = text()  # the PEFT directory, as the worker's file system names it


@dataclass
class UnloadLoraAdapter:
    TYPE: ClassVar[str] = "unload_lora_adapter"
    request_id: str = ident()
    name: str = text(max_len=MAX_LORA_NAME)


@dataclass
class LoraAdapterAnswer:
    TYPE: ClassVar[str] = "lora_adapter_answer"
    request_id: str = ident()
    worker_id: str = ident()
    status: str = text(max_len=8, choices=LORA_STATUSES)
    error: str = bounded(default="", max_len=1024)  # the worker's reason, when refused


MESSAGE_TYPES[LoadLoraAdapter.TYPE] = LoadLoraAdapter
MESSAGE_TYPES[UnloadLoraAdapter.TYPE] = UnloadLoraAdapter
MESSAGE_TYPES[LoraAdapterAnswer.TYPE] = LoraAdapterAnswer

LoraCommand = LoadLoraAdapter | UnloadLoraAdapter


def _encode(msg: Any) -> bytes:
    """``encode`` types its argument as the protocol's common ``Message`` union; these types
    register themselves in ``MESSAGE_TYPES`` instead (as ``cache_reset.py``'s do)."""
    return encode(msg)


def _client(bus: Bus) -> Any:
    if bus.nc is None:
        raise RuntimeError("the bus is not connected")
    return bus.nc


def lora_subject(subjects: Subjects, worker_id: str) -> str:
    if not is_subject_token(worker_id):
        raise ValueError(f"{worker_id!r} is not a valid subject token")
    return f"{subjects.namespace}.admin.{worker_id}.lora"


async def answer_lora_commands(
    bus: Bus, worker_id: str, apply: Callable[[LoraCommand], Awaitable[tuple[str, str]]]
) -> None:
    """Answer loads and unloads on this worker's LoRA subject: ``apply(command)`` gives the
    status and the reason (empty when none)."""

    async def on_msg(raw: Any) -> None:
        try:
            msg = decode_as(raw.data, LoadLoraAdapter, UnloadLoraAdapter, max_bytes=bus.max_bytes)
        except ProtocolError as exc:
            bus.count_rejected(raw.subject, exc)
            return
        if not raw.reply:
            return
        try:
            status, error = await apply(msg)
            log.info("%s %r (%s): %s %s", msg.TYPE, msg.name, msg.request_id, status, error)
            answer = LoraAdapterAnswer(
                request_id=msg.request_id, worker_id=worker_id, status=status, error=error[:1024]
            )
            await raw.respond(_encode(answer))
        except Exception:
            log.exception("%s %s failed", msg.TYPE, msg.request_id)

    await _client(bus).subscribe(lora_subject(bus.subjects, worker_id), cb=on_msg)


async def ask_all(
    bus: Bus, worker_ids: list[str], command: LoraCommand, timeout: float
) -> dict[str, LoraAdapterAnswer | str]:
    """Send ``command`` to every worker at once; per worker its answer, or why there is none."""
    return await ask_workers(
        bus,
        worker_ids,
        lambda worker_id: lora_subject(bus.subjects, worker_id),
        _encode(command),
        LoraAdapterAnswer,
        timeout,
    )
