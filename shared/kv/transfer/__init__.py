"""KV-cache transfer over UCX (ucxx): the decode worker pulls a prefill worker's leased blocks
straight into blocks it allocated in its own cache. The hand-off these pulls serve, side by
side, with the classes that do each part: ``shared/kv/contract.py``.

The engine's cache is one block-major tensor ``[num_blocks, layers, 2, block_size, kv_heads,
head_dim]``, so a run of consecutive block ids is one contiguous byte range on either side. A pull
pairs source and destination ids, cuts the pairs into runs that are consecutive on *both* sides,
and moves each run as a single UCX message - no per-layer or per-token chatter.

Both ends connect by UCX *worker address* (``KVServer.address``, published on the bus), never
through a sockaddr listener: ucxx's listener can only bind the wildcard address, while the worker
address path listens only where ``pdserve.shared.kv.ucx_config`` lets UCX's transports listen
(``--ucx-host``/``--ucx-port``). Tags are 64-bit; every pull draws a fresh random tag ``T``, so
pulls on one endpoint run concurrently and never see each other's messages::

    decode -> prefill   on the server's control tag: u32 length + msgpack {v: the wire version
                        (wire.KV_WIRE_VERSION), bus_id, token, reply_to: the decode worker's
                        UCX address, tag: T, fp: the packed fingerprint, pull: packed flags
                        (whole, sliced: the form the puller posted its receives for, checksum,
                        a streamed piece and its finality), heads [lo, hi), layers and the
                        runs (src, n)} (``request.py``)
    prefill -> decode   on T+2: one message per run, straight from / into the cache tensors
    prefill -> decode   on T+1: one fixed-size reply (ok as blocks, ok as head slices, or the
                        reason for a refusal; a yes says how many checksums per block follow)
    prefill -> decode   on T+3, if asked (``--kv-checksum``): the xxh3 hash of each pulled
                        (block, KV head), taken at lease time, which the puller checks against
                        what landed (``checksum.py``)

Tensor parallelism: each rank's cache holds only its KV heads ``[lo, hi)`` (``heads=``), and the
two ends may run different TP sizes (fingerprints are compared without ``tensor_parallel_size``).
A decode rank pulls each piece of its ``tp_layout.pull_plan`` from the prefill rank that holds it
(``pull(address=, heads=)``). ``whole`` says the heads are all the puller holds; with equal TP sizes they
are also all the server holds, and whole blocks move as above (``sliced`` false). Otherwise a run's message is, for each part of
the storage (``split=``: values, then scales for a quantized cache), its ``[run, :, :, :, heads]``
slice made contiguous, concatenated: packed into staging by the server (sent in place when the
slice is contiguous), unpacked from staging into the puller's head slice (received in place when
contiguous). The server refuses heads it does not hold.

The puller posts every receive - the reply, one per run straight into its blocks (or their
staging), the checksums - before it sends the request, all on its endpoint to the server, and
wakes once, when the last has completed: the server sends the KV the moment its checks pass,
with no round trip between its yes and the data (issue 29: on shared memory that round trip and
the Python around it cost a 1 MiB pull half its speed). The puller decides the form up front
(whole blocks where both TP sizes are equal, head slices otherwise); a server that cannot send
that form refuses. A refusal completes each posted receive with an empty message, which writes
no byte, so the connection - and every other pull on it - lives on. If the data or those
empties do not come in time, or a server from before version 2 refuses without them, the
puller aborts that endpoint, which cancels every receive still pointing into its blocks (so no
late byte can reach blocks given to another request) and, UCX pairing the two peers'
endpoints, also fails the server's sends at once. A pull cancelled because its request went
away first waits a moment (``client.CANCEL_GRACE``) for the server to complete its receives -
the KV under way, or a held piece refused - and aborts only if it does not: an abort fails
every pull on that connection, and the new endpoint after it too, until the peer notices.

Layer-wise streaming (``stream.py``): a lease taken while prefill still writes its blocks is
pulled as pieces, one per group of layers, each request saying ``layers: [lo, hi]`` and, for the
last, ``final``; its runs travel as one message per block and part (``part[block, lo:hi]``),
and the server holds each request until prefill has written those layers, the final one until
the first token exists, which its reply carries (bytes 6-14).

The server checks the lease's secret token before anything else - until then it does not even
connect back to the address in the request - then the layout fingerprint and that every requested
block belongs to the lease. Leased blocks are pinned while they are being sent, so a lease that
expires mid-transfer is freed only after the last byte left.
"""

from pdserve.shared.kv.transfer.checksum import KVChecksumError
from pdserve.shared.kv.transfer.client import KVClient
from pdserve.shared.kv.transfer.lease import Lease, LeaseTable
from pdserve.shared.kv.transfer.server import KVServer
from pdserve.shared.kv.transfer.stream import KVStreamFinished, pull_streamed
from pdserve.shared.kv.transfer.wire import (
    FingerprintMismatch,
    KVTransferError,
    TransferStats,
    block_runs,
    blocks_for_tokens,
    format_address,
    parse_address,
)

__all__ = [
    "FingerprintMismatch",
    "KVChecksumError",
    "KVClient",
    "KVServer",
    "KVStreamFinished",
    "KVTransferError",
    "Lease",
    "LeaseTable",
    "TransferStats",
    "block_runs",
    "pull_streamed",
    "blocks_for_tokens",
    "format_address",
    "parse_address",
]
