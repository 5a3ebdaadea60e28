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
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Sequence

import torch

from pdserve.services.engine.commands import BlockHoldRefused
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.model_setup import kv_parts
from pdserve.shared.bus.lease_messages import KVHandle
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
from pdserve.shared.kv.tp_layout import TP_KEY, kv_head_range
from pdserve.shared.kv.transfer import KVClient, KVTransferError, Lease, LeaseTable

log = logging.getLogger(__name__)


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


def probe_heads(engine: LLMEngine, handle: KVHandle) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the heads the prefill worker's rank 0 holds, the heads probed): a probe moves rank 0's
    heads to rank 0, the ones both hold. Every rank 0 holds head 0, so they always share some;
    at equal TP they share all, and the probe moves whole blocks."""
    kv_heads = engine.model_config.num_kv_heads
    source = kv_head_range(kv_heads, int(handle.fingerprint.get(TP_KEY, 1)), 0)
    lo, hi = engine.kv_heads
    return source, (max(lo, source[0]), min(hi, source[1]))


def slice_matches(
    engine: LLMEngine, source: tuple[int, int], heads: tuple[int, int], block: int, probe_id: str
) -> bool:
    """Whether our ``block`` holds, in ``heads``, what the probe's source block (the prefill
    rank's own heads, filled with the probe pattern) holds there."""
    ours = engine.kv_heads
    if source == heads == ours:
        return block_matches(engine.kv_cache[block], probe_id)
    spec = dataclasses.replace(engine.kv_spec, num_kv_heads=source[1] - source[0])
    src = spec.allocate(1, torch.device("cpu"))
    fill_block(src[0], probe_id)
    parts = engine.kv_split(engine.kv_cache[block : block + 1])
    for mine, theirs in zip(parts, kv_parts(spec)(src), strict=True):
        got = mine[:, :, :, :, heads[0] - ours[0] : heads[1] - ours[0]].cpu()
        want = theirs[:, :, :, :, heads[0] - source[0] : heads[1] - source[0]]
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            return False
    return True


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
    reply = ProbeLeaseReply(probe_id=req.probe_id, worker_id=worker_id, status="refused")
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
    reply = ProbePullReply(probe_id=req.probe_id, worker_id=worker_id, status="refused")
    _with_ranks(reply, ranks)
    block = await _hold_block(engine, req.probe_id, worker_id, draining)
    if isinstance(block, str):
        reply.error = block
        return reply
    try:
        source, heads = probe_heads(engine, req.kv)
        for _ in range(req.pulls):
            stats = await kv_client.pull(
                req.probe_id, req.kv, [block], timeout=max(0.1, req.timeout), heads=heads
            )
            reply.pull_seconds.append(stats.seconds)
            reply.num_bytes = stats.num_bytes
        check = functools.partial(slice_matches, engine, source, heads)
        reply.verified = await asyncio.to_thread(check, block, req.probe_id)
        reply.status = "ok" if reply.verified else "failed"
        reply.error = None if reply.verified else "the pulled block does not hold the probe bytes"
    except KVTransferError as exc:  # fingerprint mismatch, refusal, timeout, unreachable
        reply.status, reply.error = "failed", str(exc)[:1000]
    finally:
        # a failed pull aborted its endpoint, so nothing writes into the block any more
        engine.release(req.probe_id)
    log.info("probe %s from %s: %s", req.probe_id, req.kv.worker_id, reply.error or "ok")
    return reply
