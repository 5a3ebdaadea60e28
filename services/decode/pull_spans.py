"""The ``kv.transfer`` spans of a decode worker's pulls: one per rank pair of a pull, one for a
streamed pull (its pieces as events), or one marked with the checksum mismatch that failed it."""

from __future__ import annotations

import logging
import time

from pdserve.services.decode.decode_state import DecodeState
from pdserve.services.decode.rank_pull import PiecePull
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.kv.transfer import KVChecksumError, TransferStats
from pdserve.shared.telemetry import tracing

log = logging.getLogger(__name__)


def record_pieces(
    state: DecodeState,
    worker_id: str,
    handle: KVHandle,
    pieces: list[PiecePull],
    start_ns: int,
    checksum: bool,
) -> None:
    """One span per rank pair of a bulk pull, each from the pull's start to the piece's end."""
    for piece in pieces:
        stats = piece.stats
        attributes = {
            **tracing.kv_transfer_attributes(
                state.client_id, stats.num_bytes, stats.num_blocks, stats.seconds, "ucx"
            ),
            tracing.ATTR_WORKER_ID: worker_id,
            "pdserve.kv.messages": stats.num_messages,
            "pdserve.prefill_worker": handle.worker_id,
            "pdserve.kv.decode_rank": piece.decode_rank,
            "pdserve.kv.prefill_rank": piece.piece.prefill_rank,
            "pdserve.kv.heads": f"{piece.piece.lo}-{piece.piece.hi}",
        }
        if checksum:
            attributes[tracing.ATTR_KV_CHECKSUM] = "ok"
            attributes["pdserve.kv.checksum_seconds"] = stats.checksum_seconds
        end_ns = start_ns + int(stats.seconds * 1e9)
        tracing.record_span(
            tracing.SPAN_KV_TRANSFER, start_ns, end_ns, context=state.context, attributes=attributes
        )


def record_streamed(
    state: DecodeState, worker_id: str, handle: KVHandle, stats: TransferStats, start_ns: int
) -> None:
    """A streamed pull's span: from its start, during the prefill worker's last pass, to its
    last piece (which waited for the first token); ``kv.piece`` events say when each layer
    group was in. Beside that pass's ``prefill.forward`` span it shows the overlap."""
    attributes = {
        **tracing.kv_transfer_attributes(
            state.client_id, stats.num_bytes, stats.num_blocks, stats.seconds, "ucx"
        ),
        tracing.ATTR_WORKER_ID: worker_id,
        "pdserve.kv.messages": stats.num_messages,
        "pdserve.prefill_worker": handle.worker_id,
        "pdserve.kv.streamed": True,
        "pdserve.kv.pieces": len(stats.piece_seconds),
    }
    events = [
        ("kv.piece", {"pdserve.kv.piece": i, "pdserve.kv.piece_seconds": at})
        for i, at in enumerate(stats.piece_seconds)
    ]
    end_ns = start_ns + int(stats.seconds * 1e9)
    tracing.record_span(
        tracing.SPAN_KV_TRANSFER,
        start_ns,
        end_ns,
        context=state.context,
        attributes=attributes,
        events=events,
    )


def record_mismatch(
    state: DecodeState,
    worker_id: str,
    handle: KVHandle,
    exc: KVChecksumError,
    start_ns: int,
    policy: str,
) -> None:
    """A pull that failed its checksum (pulled KV that is not what was leased): logged, and a
    span in error with the mismatch as an event; ``policy`` (the KV failure policy) then fails
    or recomputes the request."""
    log.error(
        "KV of %s from %s is corrupt, not served (%s): %s",
        state.bus_id,
        handle.worker_id,
        policy,
        exc,
    )
    attributes = {
        tracing.ATTR_REQUEST_ID: state.client_id,
        tracing.ATTR_WORKER_ID: worker_id,
        "pdserve.prefill_worker": handle.worker_id,
        tracing.ATTR_KV_CHECKSUM: "mismatch",
    }
    event = (tracing.EVENT_KV_CHECKSUM_MISMATCH, {"message": str(exc)})
    tracing.record_span(
        tracing.SPAN_KV_TRANSFER,
        start_ns,
        time.time_ns(),
        context=state.context,
        attributes=attributes,
        error=str(exc),
        events=[event],
    )
