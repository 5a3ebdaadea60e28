"""The workers' side of ``pdserve doctor``'s stack check (messages: ``shared/kv/probe.py``).

A probe moves one KV block through the real transfer path without touching serving: it asks the
engine for a block from the free list (``engine.hold_block``), never one a sequence holds, and
gives it back as soon as it is done (the prefill side when its lease is released or expires, the
decode side right after the pull). Whenever the block might be missed - requests queued, no
block to spare under the engine's admission policy, the worker draining - the probe is refused
instead, and the doctor reports "busy". The engine decides that on its own thread, so the
answer and the block are taken at one moment.

The probe's sequence id is the probe id itself, so it cannot collide with a request's (those are
gateway ids) and shows up under that name in logs if anything goes wrong.

Each handler is handed exactly what it uses - the worker's engine, its lease table or KV client,
its id, whether it drains and its TP ranks - so this module knows no worker (the workers import
it). Every reply says which UCX transports the worker's ranks use, for the doctor to report.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence

import torch

from pdserve.services.engine.commands import BlockHoldRefused
from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.bus.protocol import KVHandle
from pdserve.shared.kv import ucx_check
from pdserve.shared.kv.probe import (
    MAX_PROBE_LEASES,
    MAX_PROBE_TTL,
    PROBE_PREFIX,
    ProbeLeaseReply,
    ProbeLeaseRequest,
    ProbePullReply,
    ProbePullRequest,
)
from pdserve.shared.kv.transfer import KVClient, KVTransferError, Lease, LeaseTable

log = logging.getLogger("pdserve.probe")


def probe_pattern(num_bytes: int, probe_id: str) -> torch.Tensor:
    """The bytes a probe block carries: different for every probe, so a stale block fails."""
    salt = int.from_bytes(hashlib.blake2b(probe_id.encode(), digest_size=2).digest(), "little")
    return ((torch.arange(num_bytes, dtype=torch.int64) * 131 + salt) % 251).to(torch.uint8)


def block_bytes(block: torch.Tensor) -> torch.Tensor:
    return block.reshape(-1).view(torch.uint8)


def fill_block(block: torch.Tensor, probe_id: str) -> None:
    flat = block_bytes(block)
    flat.copy_(probe_pattern(flat.numel(), probe_id).to(flat.device))


def block_matches(block: torch.Tensor, probe_id: str) -> bool:
    flat = block_bytes(block)
    return bool(torch.equal(flat.cpu(), probe_pattern(flat.numel(), probe_id)))


def _bad_probe(leases: LeaseTable, probe_id: str) -> str | None:
    if not probe_id.startswith(PROBE_PREFIX):
        return f"probe ids start with {PROBE_PREFIX!r}"
    if leases.token_of(probe_id) is not None:
        return f"probe {probe_id} exists"
    if leases.count(PROBE_PREFIX) >= MAX_PROBE_LEASES:
        return f"busy: {MAX_PROBE_LEASES} probe leases held already"
    return None


async def _hold_block(
    engine: LLMEngine, probe_id: str, worker_id: str, draining: bool
) -> int | str:
    """A free block held under the probe's id, or why there is none to spare."""
    if draining:
        return f"{worker_id} is draining"
    held = engine.hold_block(probe_id)
    try:
        return await asyncio.wrap_future(held)
    except BlockHoldRefused as exc:
        return str(exc)
    except asyncio.CancelledError:
        engine.release(probe_id)  # applied after the hold: a block taken goes back
        raise


def _with_ranks(reply: ProbeLeaseReply | ProbePullReply, ranks: Sequence[dict]) -> None:
    """The worker's transport facts: its warnings, and a TP worker's ranks (``Worker.tp_ranks``:
    pid and UCX transports of each, by rank)."""
    reply.warnings = ucx_check.transport_warnings()
    reply.rank_pids = [r["pid"] for r in ranks]
    reply.rank_transports = [list(r["transports"]) for r in ranks]


async def lease_probe(
    req: ProbeLeaseRequest,
    engine: LLMEngine,
    leases: LeaseTable,
    make_handle: Callable[[Lease], KVHandle],
    worker_id: str,
    draining: bool,
    ranks: Sequence[dict] = (),
) -> ProbeLeaseReply:
    """Lease one block filled with the probe's pattern, as a prefill result leases its KV
    (``make_handle``: the prefill worker's, which names its KV server)."""
    reply = ProbeLeaseReply(req.probe_id, worker_id, "refused")
    _with_ranks(reply, ranks)
    reply.error = _bad_probe(leases, req.probe_id)
    block = reply.error or await _hold_block(engine, req.probe_id, worker_id, draining)
    if isinstance(block, str):
        reply.error = block
        return reply
    try:
        await asyncio.to_thread(fill_block, engine.kv_cache[block], req.probe_id)
    except BaseException:
        engine.release(req.probe_id)
        raise
    ttl = min(max(req.ttl, 0.1), MAX_PROBE_TTL)
    # from here the lease owns the block: released by the doctor, or freed on expiry
    reply.kv = make_handle(leases.add(req.probe_id, [block], 1, ttl))
    reply.status, reply.error = "ok", None
    return reply


async def pull_probe(
    req: ProbePullRequest,
    engine: LLMEngine,
    kv_client: KVClient,
    worker_id: str,
    draining: bool,
    ranks: Sequence[dict] = (),
) -> ProbePullReply:
    """Pull the probe's block ``req.pulls`` times into a free block, check it, free it."""
    reply = ProbePullReply(req.probe_id, worker_id, "refused")
    _with_ranks(reply, ranks)
    block = await _hold_block(engine, req.probe_id, worker_id, draining)
    if isinstance(block, str):
        reply.error = block
        return reply
    try:
        for _ in range(req.pulls):
            stats = await kv_client.pull(
                req.probe_id, req.kv, [block], timeout=max(0.1, req.timeout)
            )
            reply.pull_seconds.append(stats.seconds)
            reply.num_bytes = stats.num_bytes
        cache = engine.kv_cache
        reply.verified = await asyncio.to_thread(block_matches, cache[block], req.probe_id)
        reply.status = "ok" if reply.verified else "failed"
        reply.error = None if reply.verified else "the pulled block does not hold the probe bytes"
    except KVTransferError as exc:  # fingerprint mismatch, refusal, timeout, unreachable
        reply.status, reply.error = "failed", str(exc)[:1000]
    finally:
        # a failed pull aborted its endpoint, so nothing writes into the block any more
        engine.release(req.probe_id)
    log.info("probe %s from %s: %s", req.probe_id, req.kv.worker_id, reply.error or "ok")
    return reply
