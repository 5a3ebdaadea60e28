"""The KV hand-off between a prefill worker and a decode worker, as one contract.

A prefill worker computes a prompt's KV and keeps the blocks under a lease; a decode worker
pulls them into blocks it reserved, then lets the lease go. This module names what each side
does, as Protocols, and says which class does it today; ``tests/unit/test_kv_contract.py``
checks that those classes fit (members and signatures). The bytes of one pull on the wire are
in ``shared/kv/transfer/__init__.py``; the request's whole path in the README's "How a request
flows".

Prefill side, ``KVPrefillSide`` (``services/prefill/worker.py:PrefillWorker``):

    lease          ``KVLeases.add``: the parked prompt's blocks, a time to live, a secret
                   token and an epoch, the highest generation of its blocks (``LeaseTable``,
                   ``shared/kv/transfer/lease.py``; generations: ``BlockManager``); the worker's
                   ``make_handle`` turns the lease into the ``KVHandle`` the gateway carries.
    stream layers  ``KVLayerFeed.advance`` / ``finish`` / ``end``: how far the pass that
                   completes a streamed lease has written, then its first token, or why it
                   never will (``LayerStream``, ``shared/kv/transfer/stream.py``; fed from the
                   engine thread by ``services/engine/kv_stream.py:StreamHooks``).
    serve pulls    ``KVPullServer.start`` / ``stop`` / ``address``: answer each pull that shows
                   its lease's token (``KVServer``, ``shared/kv/transfer/server.py``).
    release        ``KVLeases.release``: the puller is done, or the request was cancelled;
                   ``KVLeases.expire``: nobody pulled in time. The blocks go back to the engine
                   once no send reads them (``LLMEngine.release``).

Decode side, ``KVDecodeSide`` (``services/decode/worker.py:DecodeWorker``):

    pull           ``KVPuller.pull``: every rank's pieces of one request's KV
                   (``RankPuller``, ``services/decode/rank_pull.py``), each piece a
                   ``KVPiecePuller.pull`` (``KVClient``, ``shared/kv/transfer/client.py``); a
                   streamed lease as layer groups (``shared/kv/transfer/stream.py:pull_streamed``).
    on ready       ``KVPullAnswers.kv_ready``: the reserved blocks hold the prompt's KV (and, for
                   a streamed pull, the first token): the sequence joins the batch.
    on failure     ``KVPullAnswers.kv_failed``: ``--kv-failure-policy`` fails the request,
                   computes the prompt here, or (``reprefill``) fails it with ``kv_reprefill``, and
                   the gateway prefills it again on another prefill worker
                   (``gateway/inflight/prefill_stage.py:PrefillStage.reprefill``). Both are
                   ``LLMEngine``'s commands, applied on the engine thread by
                   ``services/engine/kv_arrivals.py:KVArrivals``.

The hand-off, one request (NATS messages: ``shared/bus/*_messages.py``; ``<ns>`` is the
namespace)::

    gateway                        prefill worker                        decode worker
       |                                 |                                     |
       |-- PrefillRequest -------------->|                                     |
       |   NATS <ns>.prefill.<id>        | queue, forward pass(es),            |
       |                                 | sample the first token              |
       |                                 | lease = leases.add(blocks, ttl)     |
       |                                 | (TP > 1: mirrored to every rank)    |
       |<-- PrefillResult ---------------|                                     |
       |   first token, KVHandle:        |                                     |
       |   address, block ids, token,    |                                     |
       |   layout fingerprint            |                                     |
       |-- DecodeRequest: prompt, first token, KVHandle ---------------------->|
       |   NATS <ns>.decode.<id>         |                                     |
       |                                 |                     reserve blocks  |
       |                                 |<-- pull request (UCX, control tag) -|
       |                                 |   bus id, lease token, epoch,       |
       |                                 |   layout, runs, heads [, layers]    |
       |                                 | token? layout? blocks? epoch?       |
       |                                 | reused since? pin lease             |
       |                                 |-- reply, then the runs (tag T) ---->|
       |                                 |   straight into reserved blocks     |
       |                                 |           kv_ready: joins batch     |
       |                                 |<-- ReleaseLease --------------------|
       |                                 |   NATS <ns>.lease.<id>              |
       |                                 | leases.release: the blocks go       |
       |                                 | back once no send reads them        |
       |<-- TokenBatch, every step (NATS, the gateway's inbox) ----------------|

Expiry: a lease nobody releases is freed by ``leases.expire()`` on the prefill worker's
housekeeping, ``--lease-seconds`` after it was taken (for a streamed lease: after its prompt is
complete). A lease released or expired while a send still reads it is freed after the last
byte; a release that the bus loses is the same as an expiry.

Streamed pieces (``--kv-stream-threshold``): the lease is taken when the forward pass that
completes the prompt starts, and a ``PrefillResult`` with no token and a ``streaming`` handle
goes out at once. The decode worker asks for ``--kv-stream-layer-groups`` pieces together, one
per group of layers; the server holds each until ``LayerStream.advance`` has passed its layers,
and the final one until ``finish(first_token)``, whose token its reply carries. Blocks complete
before the pass (earlier chunks, a cached prefix) go at once, in a piece of their own.
``end(reason)`` refuses what still waits: a request that ended at its first token is dropped
quietly (``KVStreamFinished``), any other reason is a failed pull.

Failure policy - never a silent 200 with wrong output:

- a pull without the lease's token gets no reply, and no connection back;
- a lease gone, a layout fingerprint that differs beyond TP, blocks outside the lease or heads
  the server does not hold: a refusal with its reason (``KVTransferError``,
  ``FingerprintMismatch``);
- no answer in time (``--kv-pull-timeout``, 30 s; a streamed pull waits up to the request's
  deadline, but never that long without a piece) or the client gone (its cancel cancels the
  pull): the endpoint is aborted, so no late byte lands in blocks given to another request;
- bytes that differ from the hashes taken at lease time (``--kv-checksum``):
  ``KVChecksumError``, counted and marked on the ``kv.transfer`` span.

Whatever the failure, the decode worker releases the lease and tells the engine ``kv_failed``, never
``kv_ready``; ``--kv-failure-policy`` then fails the request (the default), recomputes its prompt on
the decode worker, or (``reprefill``) has the gateway prefill it again on another prefill worker and
send it to decode anew (on a decode worker where none is left). A decode worker that turns a request
away before pulling (draining, full, past its deadline) releases its lease at once, and the gateway
releases the lease of any prefill answer nobody will pull
(``gateway/inflight/outbox.py:Outbox.release_stale``). A prefill worker that dies fails the pulls
from it; a decode worker that dies leaves its leases to expire.

Beyond one rank, each rank serves and pulls its own KV heads through its own endpoint
(``services/engine/parallel/kv_agent.py``; which ranks: ``shared/kv/tp_layout.py``), rank 0
deciding for all. ``pdserve doctor`` probes the same path with one held block
(``shared/kv/probe.py``, ``services/probe.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pdserve.shared.bus.lease_messages import KVHandle
    from pdserve.shared.kv.transfer.heads import Heads
    from pdserve.shared.kv.transfer.lease import Lease
    from pdserve.shared.kv.transfer.wire import TransferStats


# -- prefill side ------------------------------------------------------------------------------


@runtime_checkable
class KVLeases(Protocol):
    """Lease and release: the blocks a prefill worker holds for pullers (``LeaseTable``)."""

    def add(
        self, bus_id: str, block_ids: list[int], num_tokens: int, ttl: float, stream: Any = None
    ) -> Lease:
        """Lease ``block_ids`` for ``ttl`` seconds under a fresh token; ``stream`` (a
        ``KVLayerFeed``) while prefill still writes them."""
        ...

    def get(self, bus_id: str) -> Lease | None:
        """The live lease of a request, if any."""
        ...

    def restart(self, lease: Lease, ttl: float) -> None:
        """A streamed lease's prompt is complete: its time to live starts now."""
        ...

    def release(self, bus_id: str) -> bool:
        """The puller is done (or the request ended): free the blocks once no send reads them.
        False when there was no lease."""
        ...

    def expire(self) -> list[str]:
        """Release every lease past its time; the ids of those released."""
        ...


@runtime_checkable
class KVLayerFeed(Protocol):
    """Stream layers: how far the pass that completes a streamed lease has written
    (``LayerStream``). Each call wakes the pieces waiting on it."""

    def advance(self, layers: int, event: Any = None) -> None:
        """Layers below ``layers`` hold every token (``event``: a CUDA event behind them)."""
        ...

    def finish(self, first_token: int, event: Any = None) -> None:
        """The pass is over and the first token sampled: every piece may go, the last with it."""
        ...

    def end(self, reason: str) -> None:
        """The prompt will never be complete: the pieces still waiting are refused."""
        ...


@runtime_checkable
class KVPullServer(Protocol):
    """Serve pulls: answers every pull that shows its lease's token (``KVServer``)."""

    @property
    def address(self) -> str:
        """Where pullers reach it (UCX worker address and control tag), set by ``start``."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Stop answering; sends in flight are aborted."""
        ...


@runtime_checkable
class KVPrefillSide(Protocol):
    """A prefill worker's part of the hand-off (``PrefillWorker``)."""

    @property
    def leases(self) -> KVLeases: ...

    @property
    def kv_server(self) -> KVPullServer | None:
        """None until the worker has started."""
        ...

    @property
    def streams(self) -> Mapping[str, KVLayerFeed]:
        """Streamed leases whose pass is still running, by request."""
        ...

    def make_handle(self, lease: Lease) -> KVHandle:
        """What a decode worker needs to pull ``lease``: address(es), blocks, token, layout."""
        ...


# -- decode side -------------------------------------------------------------------------------


@runtime_checkable
class KVPiecePuller(Protocol):
    """One endpoint's pulls: a piece of a pull, from one server (``KVClient``)."""

    async def pull(
        self,
        bus_id: str,
        handle: KVHandle,
        dst_block_ids: list[int],
        timeout: float = 30.0,
        *,
        address: str | None = None,
        heads: Heads | None = None,
        layers: tuple[int, int] | None = None,
        final: bool = False,
        span: tuple[int, int] | None = None,
    ) -> TransferStats:
        """Copy the handle's blocks (its ``heads``, ``layers`` and ``span`` of them) into
        ``dst_block_ids``; raises ``KVTransferError`` (or a subclass) when it cannot."""
        ...

    def check(self, handle: KVHandle) -> None:
        """Raise ``FingerprintMismatch`` unless the handle's layout is ours but for TP."""
        ...

    async def connect(self, address: str) -> None:
        """Set up the endpoint to a prefill worker before its first pull."""
        ...

    def disconnect(self, address: str) -> None:
        """Drop the endpoint to a prefill worker that left."""
        ...


@runtime_checkable
class KVPuller(Protocol):
    """Pull: one request's KV over every rank pair (``RankPuller``)."""

    async def pull(
        self, bus_id: str, handle: KVHandle, blocks: list[int], timeout: float
    ) -> tuple[TransferStats, list[Any]]:
        """Pull ``handle``'s blocks into ``blocks``: the summed stats and each piece's
        (``services/decode/rank_pull.py:PiecePull``); raises ``KVTransferError`` when any
        piece fails."""
        ...


@runtime_checkable
class KVPullAnswers(Protocol):
    """On ready, on failure: what the engine hears once a pull into its reserved blocks is
    over (``LLMEngine``, which posts them to its thread; ``Scheduler`` applies them there)."""

    def kv_ready(self, bus_id: str, first_token: int | None = None) -> None:
        """The blocks hold the prompt's KV: the sequence runs (a streamed pull's token too)."""
        ...

    def kv_failed(self, bus_id: str, error: str) -> object:
        """The pull failed or never ran: ``--kv-failure-policy`` fails the request or computes
        the prompt here. (The scheduler returns the error output; the engine, nothing.)"""
        ...


@runtime_checkable
class KVDecodeSide(Protocol):
    """A decode worker's part of the hand-off (``DecodeWorker``)."""

    @property
    def puller(self) -> KVPuller | None:
        """None until the worker has started."""
        ...

    @property
    def kv_client(self) -> KVPiecePuller | None:
        """Rank 0's endpoint: streamed pulls and the connections to prefill workers."""
        ...

    @property
    def engine(self) -> KVPullAnswers | None: ...
