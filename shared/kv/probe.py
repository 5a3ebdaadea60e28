"""Probe messages: ``pdserve doctor`` asks running workers to move one KV block.

A probe takes the real path of a request's KV - lease, UCX pull, release - with a single block
that no request is using::

    doctor -ProbeLeaseRequest-> {ns}.probe.{prefill}   -> ProbeLeaseReply (KV handle of 1 block)
    doctor -ProbePullRequest->  {ns}.probe.{decode}    -> ProbePullReply (pull times, checked)
    doctor -ReleaseLease->      {ns}.lease.{prefill}   the block goes back, as after a real pull

Both are NATS request/reply: the reply goes to the requester's own inbox, so a probe never
publishes on a subject a message chose. The prefill worker fills the block with a pattern
derived from the probe id and the decode worker checks it, so a probe also proves the bytes
landed in the right place. A worker refuses a probe (``status="refused"``) rather than take a
block a request may need. Every reply also lists a TP worker's ranks (pid, UCX transports), which
the doctor reports. These types live here, registered into ``pdserve.shared.bus.protocol``'s table,
because only the doctor and the workers' probe handlers speak them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.bus.protocol import MESSAGE_TYPES, ProtocolError, decode_as, encode
from pdserve.shared.bus.subjects import Subjects, is_subject_token
from pdserve.shared.bus.wire_fields import count, ident, seconds, text

log = logging.getLogger(__name__)

MAX_PROBE_TTL = 30.0  # seconds a probe lease may live if the doctor never releases it
MAX_PROBE_LEASES = 4  # probe leases one prefill worker holds at once: probes never hoard blocks
PROBE_PREFIX = "doctor-"  # every probe id starts with it, so a worker can count its probes
MAX_PROBE_PULLS = 10
PROBE_STATUSES = ("ok", "refused", "failed")
MAX_TP_RANKS = 64  # as KVHandle.rank_addresses
MAX_RANK_TRANSPORTS = 64  # ucx_check.MAX_PROCESS_TRANSPORTS
MAX_TRANSPORT_CHARS = 64
MAX_PID = (1 << 31) - 1


# Both replies say who answers: a worker of TP > 1 lists its ranks (index: rank, 0 first), each
# one's pid and the UCX resources (``transport/device``) its KV endpoint's process opened
# (``ucx_check.process_transports``). Empty for TP 1. The two lists go together.
def _rank_pids() -> Any:
    return field(default_factory=list, metadata={"lo": 1, "hi": MAX_PID, "max_len": MAX_TP_RANKS})


def _rank_transports() -> Any:
    return field(default_factory=list, metadata={"max_len": MAX_TP_RANKS})


def check_ranks(pids: list[int], transports: list[list[str]]) -> None:
    """What the wire checker cannot say per field (it raises ProtocolError from this)."""
    if len(transports) != len(pids):
        raise ValueError(f"{len(pids)} rank pids but {len(transports)} rank transport lists")
    for rank, found in enumerate(transports):
        if len(found) > MAX_RANK_TRANSPORTS:
            raise ValueError(f"rank {rank}: more than {MAX_RANK_TRANSPORTS} transports")
        if any(len(t) > MAX_TRANSPORT_CHARS for t in found):
            raise ValueError(f"rank {rank}: a transport name over {MAX_TRANSPORT_CHARS} chars")


@dataclass
class ProbeLeaseRequest:
    TYPE: ClassVar[str] = "probe_lease_request"
    probe_id: str = ident()
    ttl: float = seconds(default=10.0)


@dataclass
class ProbeLeaseReply:
    TYPE: ClassVar[str] = "probe_lease_reply"
    probe_id: str = ident()
    worker_id: str = ident()
    status: str = text(max_len=16, choices=PROBE_STATUSES)
    kv: KVHandle | None = field(default=None)
    error: str | None = text(default=None)
    warnings: list[str] = field(default_factory=list, metadata={"max_len": 16})
    rank_pids: list[int] = _rank_pids()
    rank_transports: list[list[str]] = _rank_transports()

    def __post_init__(self) -> None:
        check_ranks(self.rank_pids, self.rank_transports)


@dataclass
class ProbePullRequest:
    TYPE: ClassVar[str] = "probe_pull_request"
    probe_id: str = ident()
    kv: KVHandle = field(metadata={})  # the prefill worker's ProbeLeaseReply.kv
    pulls: int = count(lo=1, hi=MAX_PROBE_PULLS, default=3)
    timeout: float = seconds(default=5.0)


@dataclass
class ProbePullReply:
    TYPE: ClassVar[str] = "probe_pull_reply"
    probe_id: str = ident()
    worker_id: str = ident()
    status: str = text(max_len=16, choices=PROBE_STATUSES)
    pull_seconds: list[float] = field(default_factory=list, metadata={"max_len": MAX_PROBE_PULLS})
    num_bytes: int = count(default=0)
    verified: bool = field(default=False)  # the block holds the prefill side's pattern
    error: str | None = text(default=None)
    warnings: list[str] = field(default_factory=list, metadata={"max_len": 16})
    rank_pids: list[int] = _rank_pids()
    rank_transports: list[list[str]] = _rank_transports()

    def __post_init__(self) -> None:
        check_ranks(self.rank_pids, self.rank_transports)


PROBE_TYPES = (ProbeLeaseRequest, ProbeLeaseReply, ProbePullRequest, ProbePullReply)
MESSAGE_TYPES.update({cls.TYPE: cls for cls in PROBE_TYPES})


def probe_subject(subjects: Subjects, worker_id: str) -> str:
    if not is_subject_token(worker_id):
        raise ValueError(f"{worker_id!r} is not a valid subject token")
    return f"{subjects.namespace}.probe.{worker_id}"


ProbeHandler = Callable[[Any], Awaitable[Any]]


async def answer_probes(
    bus: Bus, worker_id: str, accept: tuple[type, ...], handler: ProbeHandler
) -> None:
    """Answer probe requests on this worker's probe subject with ``handler(msg)``'s reply.

    Requests are schema-checked like every bus message; anything else gets no answer.
    """

    async def on_msg(raw: Any) -> None:
        try:
            msg = decode_as(raw.data, *accept, max_bytes=bus.max_bytes)
        except ProtocolError as exc:
            bus.count_rejected(raw.subject, exc)
            return
        if not raw.reply:
            return
        try:
            reply = await handler(msg)
            await raw.respond(encode(reply))
        except Exception:
            log.exception("probe %s failed", getattr(msg, "probe_id", "?"))

    await bus.nc.subscribe(probe_subject(bus.subjects, worker_id), cb=on_msg)


async def request(bus: Bus, subject: str, msg: Any, reply_type: type, timeout: float) -> Any:
    """Send one probe request and return its checked reply (raises on timeout/no responders)."""
    answer = await bus.nc.request(subject, encode(msg), timeout=timeout)
    return decode_as(answer.data, reply_type, max_bytes=bus.max_bytes)
