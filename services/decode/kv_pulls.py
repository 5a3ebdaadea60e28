"""The decode worker's KV pulls: a prefilled request's KV pulled into the blocks the engine
reserved for it, and the lease on the prefill worker's blocks released exactly once.

The engine hands out a ``KVPull`` once it has reserved a request's blocks; the pull answers it
once, ``kv_ready`` or ``kv_failed`` (then ``kv_failure_policy`` recomputes the prompt here or
ends the request with an error). A streamed handle is pulled layer by layer while prefill still
computes (``shared/kv/transfer/stream.py``); any other one piece by piece over every rank pair
(``rank_pull.py``). Apart from ``worker.py``, which admits requests and streams their tokens:
this is the one place a pull's outcome is decided, counted and traced (``pull_spans.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.services.background_tasks import BackgroundTasks
from pdserve.services.decode import pull_spans
from pdserve.services.decode.decode_state import DecodeState
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import KVPull
from pdserve.services.request_state import RequestState
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.subjects import Subjects
from pdserve.shared.config import WorkerConfig
from pdserve.shared.kv.contract import KVPuller
from pdserve.shared.kv.transfer import KVChecksumError, KVClient, KVStreamFinished, KVTransferError
from pdserve.shared.kv.transfer.stream import pull_streamed
from pdserve.shared.telemetry.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# A bulk pull's bound is --kv-pull-timeout, and a streamed pull's between two pieces: past it
# the pull counts as failed (a prefill worker killed mid-pull sends nothing more, and UCX tag
# receives do not fail with its endpoint). A whole streamed pull also waits for the prefill
# pass it overlaps: its bound is the request's deadline (--first-token-timeout), up to this
STREAM_PULL_TIMEOUT = 600.0


class PullingWorker(Protocol):
    """What the pulls need of ``services.decode.worker.DecodeWorker``."""

    worker_id: str
    config: WorkerConfig
    engine: LLMEngine | None
    metrics: WorkerMetrics
    bus: Bus
    subjects: Subjects
    states: dict[str, RequestState]
    tasks: BackgroundTasks
    kv_client: KVClient | None
    puller: KVPuller | None


class KVPulls:
    def __init__(self, worker: PullingWorker, end: Callable[[DecodeState], None]) -> None:
        self.worker = worker
        self._end = end  # the request leaves the worker (a streamed one finished at its token)

    def start(self, pull: KVPull) -> None:
        """The engine reserved blocks for a request's KV: pull into them, or say why not."""
        state = self.worker.states.get(pull.bus_id)
        if not isinstance(state, DecodeState) or state.kv is None:
            # dropped meanwhile (its lease went with it)
            self._engine().kv_failed(pull.bus_id, "the request ended before its pull")
            return
        state.pull = self.worker.tasks.spawn(self._pull(state, state.kv, pull.block_ids))

    async def _pull(self, state: DecodeState, handle: KVHandle, blocks: list[int]) -> None:
        """Pull ``handle``'s blocks into ``blocks``, release its lease, answer the engine."""
        worker, engine = self.worker, self._engine()
        rid = state.bus_id
        start_ns = time.time_ns()
        bound = STREAM_PULL_TIMEOUT if handle.streaming else worker.config.kv_pull_timeout
        timeout = max(0.1, min(bound, state.deadline - time.time()))
        try:
            client, puller = worker.kv_client, worker.puller
            assert client is not None and puller is not None, "made by start_extra"
            if handle.streaming:  # layer by layer while prefill computes, the token last
                groups = worker.config.kv_stream_layer_groups
                stall = worker.config.kv_pull_timeout  # between pieces: a dead prefill worker
                stats = await pull_streamed(client, rid, handle, blocks, timeout, groups, stall)
                pieces = []
            else:
                stats, pieces = await puller.pull(rid, handle, blocks, timeout)
        except KVStreamFinished:  # the gateway has its answer from the prefill worker
            engine.abort(rid)
            engine.kv_failed(rid, "finished at its first token")  # ends it, no output
            self._end(state)
            return
        except KVTransferError as exc:
            worker.metrics.kv_pull_failures.inc()
            if worker.config.kv_failure_policy == "recompute":
                worker.metrics.kv_recomputes.inc()
            if isinstance(exc, KVChecksumError):
                worker.metrics.kv_checksum_failures.inc()
                policy = worker.config.kv_failure_policy
                pull_spans.record_mismatch(state, worker.worker_id, handle, exc, start_ns, policy)
            else:
                log.warning("KV pull for %s from %s failed: %s", rid, handle.worker_id, exc)
            engine.kv_failed(rid, str(exc))  # never kv_ready: the blocks are not served
            return
        except BaseException as exc:  # e.g. cancelled at shutdown: the engine must still know
            engine.kv_failed(rid, f"pull interrupted: {exc!r}")
            raise
        finally:
            await self.release_lease(rid, handle)
        if stats.first_token is not None:
            state.positions[0] = 1  # the first token is the prefill worker's: ours follow it
        engine.kv_ready(rid, stats.first_token)
        worker.metrics.kv_transfer_seconds.observe(stats.seconds)
        if handle.streaming:
            pull_spans.record_streamed(state, worker.worker_id, handle, stats, start_ns)
        worker.metrics.kv_transfer_bytes.inc(stats.num_bytes)
        pull_spans.record_pieces(
            state, worker.worker_id, handle, pieces, start_ns, worker.config.kv_checksum
        )

    async def release_lease(self, bus_id: str, handle: KVHandle) -> None:
        """Let the prefill worker free ``handle``'s blocks (once per request: the caller's)."""
        worker = self.worker
        try:
            await worker.bus.publish(
                worker.subjects.lease(handle.worker_id), ReleaseLease(bus_id=bus_id)
            )
        except Exception as exc:  # the lease expires on its own
            log.info("could not release the lease of %s: %s", bus_id, exc)

    def _engine(self) -> LLMEngine:
        engine = self.worker.engine
        assert engine is not None, "pulls start once the engine runs"
        return engine
