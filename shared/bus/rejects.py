"""Counting what the bus decoders refuse: ``pdserve_bus_rejected_messages_total``.

A message that fails ``pdserve.shared.bus.protocol.decode`` is dropped by the subscription that
got it (``Bus.subscribe``, and the request/reply handlers of shared/kv/probe.py and
shared/discovery/cache_reset.py), never raised into it, so junk on a subject costs a worker
nothing but the decode. This counts it by where it came (the subject's kind, the token after the
namespace: ``prefill``, ``decode``, ``gw``...) and why it was refused (``ProtocolError.reason``),
so an operator sees a misbehaving or hostile client on ``/metrics`` instead of in a log line
that is rate-limited. Labels come from fixed lists: no subject or worker id becomes a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.shared.bus.wire_check import REJECT_REASONS

SUBJECT_KINDS = (
    "prefill",
    "decode",
    "lease",
    "cancel",
    "load",
    "kv",
    "ping",
    "gw",
    "admin",
    "probe",
    "status",
    "control",
)

RejectCounts = Mapping[tuple[str, str], int]  # (subject kind, reason) -> messages


def subject_kind(subject: str, namespace: str) -> str:
    """The label of ``subject``: its first token after ``namespace``, or ``other``."""
    rest = subject[len(namespace) + 1 :] if subject.startswith(namespace + ".") else ""
    kind = rest.split(".", 1)[0]
    return kind if kind in SUBJECT_KINDS else "other"


def reject_reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", "schema")
    return reason if reason in REJECT_REASONS else "schema"


class BusRejectCollector(Collector):
    """``pdserve_bus_rejected_messages_total{subject_kind, reason}``, read from the bus's
    counts at scrape time (``counts``: e.g. ``lambda: bus.stats.rejected_by``)."""

    def __init__(self, counts: Callable[[], RejectCounts]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            "pdserve_bus_rejected_messages",
            "Bus messages dropped because they failed the protocol check (too large, not "
            "msgpack, past the unpacker's limits, wrong version, type or fields).",
            labels=["subject_kind", "reason"],
        )
        for (kind, reason), n in sorted(dict(self.counts()).items()):
            family.add_metric([kind, reason], n)
        yield family
