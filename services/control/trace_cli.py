"""``pdserve trace``: where did a request's time go? A per-phase breakdown from Jaeger.

Reads Jaeger's HTTP query API (``GET /api/traces``), by request id (the ``pdserve.request_id``
span tag) or the last N traces of a service, and splits each request's end-to-end time into

    queue        prefill.queue + decode.queue
    prefill      prefill.forward (all chunks; local prefill on a decode worker counts too)
    kv transfer  kv.transfer
    decode       decode.generate
    other        the rest of the root span: HTTP handling, tokenization, routing, NATS hops

Each phase is the union of its spans' time ranges inside the root span, so overlapping chunks
are not counted twice and ``other`` never goes negative. Jaeger searches its default window
(the last 2 days) and returns whole traces, spans of every service included.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TextIO

from pdserve.shared.telemetry import tracing

PHASES: dict[str, tuple[str, ...]] = {
    "queue": (tracing.SPAN_PREFILL_QUEUE, tracing.SPAN_DECODE_QUEUE),
    "prefill": (tracing.SPAN_PREFILL_FORWARD,),
    "kv transfer": (tracing.SPAN_KV_TRANSFER,),
    "decode": (tracing.SPAN_DECODE_GENERATE,),
}
# Phase spans may nest (the decode worker's queue span contains its KV pull), so each instant is
# credited to one phase only, the first of this order that covers it: shares then add up to 100%.
PRIORITY = ("kv transfer", "prefill", "decode", "queue")
DEFAULT_LAST = 10
HTTP_TIMEOUT_S = 15.0


class JaegerError(RuntimeError):
    """Jaeger could not be reached or answered with an error."""


@dataclass
class Breakdown:
    """One request's time, split by phase. All times in microseconds, as Jaeger stores them."""

    trace_id: str
    request_id: str
    root_name: str
    start_us: int
    total_us: int
    phases: dict[str, int]  # phase -> time; a phase without any span is absent
    other_us: int
    services: list[str]
    roots: int  # more than one means trace context was lost on some hop
    root_tags: dict[str, Any] = field(default_factory=dict)
    kv_tags: dict[str, Any] = field(default_factory=dict)
    decode_tags: dict[str, Any] = field(default_factory=dict)

    def share(self, micros: int) -> float:
        return micros / self.total_us if self.total_us > 0 else 0.0


# --- Jaeger query API --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jaeger", default="http://127.0.0.1:16686", help="Jaeger query base URL")
    p.add_argument("request_id", nargs="?", help="request id (x-request-id) to show")
    p.add_argument("--last", type=int, default=0, help="show the last N requests instead")
    p.add_argument("--service", default="pdserve-gateway", help="service whose traces are listed")


def _get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            body = json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise JaegerError(f"Jaeger answered {exc.code} for {url}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise JaegerError(f"cannot reach Jaeger at {url}: {reason}") from None
    except json.JSONDecodeError as exc:
        raise JaegerError(f"Jaeger sent something that is not JSON from {url}: {exc}") from None
    if body.get("errors"):
        msgs = "; ".join(str(e.get("msg", e)) for e in body["errors"])
        raise JaegerError(f"Jaeger reported: {msgs}")
    return body


def fetch_traces(
    base_url: str, service: str, request_id: str | None = None, limit: int = DEFAULT_LAST
) -> list[dict[str, Any]]:
    """Traces of ``service`` (with a span tagged ``pdserve.request_id=request_id`` if given)."""
    params: dict[str, str] = {"service": service, "limit": str(limit)}
    if request_id is not None:
        params["tags"] = json.dumps({tracing.ATTR_REQUEST_ID: request_id})
    url = f"{base_url.rstrip('/')}/api/traces?{urllib.parse.urlencode(params)}"
    return list(_get_json(url).get("data") or [])


# --- analysis ----------------------------------------------------------------------------------


def _tags(span: dict[str, Any]) -> dict[str, Any]:
    return {t["key"]: t.get("value") for t in span.get("tags") or []}


def _union_us(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for lo, hi in sorted(ranges):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _clip(span: dict[str, Any], lo: int, hi: int) -> tuple[int, int]:
    start = int(span["startTime"])
    end = start + int(span["duration"])
    return max(start, lo), max(min(end, hi), max(start, lo))


def find_roots(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Spans whose parent is not in the trace, earliest first."""
    ids = {s["spanID"] for s in trace["spans"]}
    roots = [
        s
        for s in trace["spans"]
        if not any(
            r.get("refType") == "CHILD_OF" and r.get("spanID") in ids
            for r in s.get("references") or []
        )
    ]
    return sorted(roots, key=lambda s: (s["startTime"], -s["duration"]))


def breakdown(trace: dict[str, Any]) -> Breakdown:
    """Split one Jaeger trace into phases."""
    spans = trace["spans"]
    processes = trace.get("processes") or {}
    roots = find_roots(trace)
    # A parent that never reached Jaeger leaves several roots; the earliest, longest one is the
    # request (normally the gateway's HTTP span).
    root = roots[0]
    lo, hi = int(root["startTime"]), int(root["startTime"]) + int(root["duration"])

    found: dict[str, int] = {}
    claimed: list[tuple[int, int]] = []
    for phase in PRIORITY:
        ranges = [_clip(s, lo, hi) for s in spans if s["operationName"] in PHASES[phase]]
        if ranges:
            before = _union_us(claimed)
            claimed.extend(ranges)
            found[phase] = _union_us(claimed) - before
    phases = {phase: found[phase] for phase in PHASES if phase in found}
    other = (hi - lo) - _union_us(claimed)

    def merged_tags(name: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in sorted(spans, key=lambda s: s["startTime"]):
            if s["operationName"] == name:
                out.update(_tags(s))
        return out

    root_tags = _tags(root)
    request_id = root_tags.get(tracing.ATTR_REQUEST_ID)
    if request_id is None:
        request_id = next(
            (
                _tags(s)[tracing.ATTR_REQUEST_ID]
                for s in spans
                if tracing.ATTR_REQUEST_ID in _tags(s)
            ),
            "?",
        )
    services = sorted(
        {processes.get(s.get("processID"), {}).get("serviceName", "?") for s in spans}
    )
    return Breakdown(
        trace_id=trace["traceID"],
        request_id=str(request_id),
        root_name=root["operationName"],
        start_us=lo,
        total_us=hi - lo,
        phases=phases,
        other_us=other,
        services=services,
        roots=len(roots),
        root_tags=root_tags,
        kv_tags=merged_tags(tracing.SPAN_KV_TRANSFER),
        decode_tags=merged_tags(tracing.SPAN_DECODE_GENERATE),
    )


# --- output ------------------------------------------------------------------------------------


def fmt_time(micros: float) -> str:
    if micros >= 10_000_000:
        return f"{micros / 1e6:.2f} s"
    return f"{micros / 1e3:.1f} ms"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _phase_note(b: Breakdown, phase: str) -> str:
    if phase == "kv transfer" and b.kv_tags:
        t = b.kv_tags
        parts = []
        if tracing.ATTR_KV_BYTES in t:
            parts.append(_fmt_bytes(float(t[tracing.ATTR_KV_BYTES])))
        if tracing.ATTR_KV_BLOCKS in t:
            parts.append(f"{t[tracing.ATTR_KV_BLOCKS]} blocks")
        if tracing.ATTR_KV_GBPS in t:
            parts.append(f"{float(t[tracing.ATTR_KV_GBPS]):.2f} GB/s")
        if tracing.ATTR_KV_TRANSPORT in t:
            parts.append(f"over {t[tracing.ATTR_KV_TRANSPORT]}")
        return ", ".join(parts)
    if phase == "decode" and b.decode_tags:
        t = b.decode_tags
        parts = []
        if tracing.GEN_AI_USAGE_OUTPUT_TOKENS in t:
            parts.append(f"{t[tracing.GEN_AI_USAGE_OUTPUT_TOKENS]} tokens")
        if tracing.ATTR_TPOT_MS in t:
            parts.append(f"{float(t[tracing.ATTR_TPOT_MS]):.1f} ms/token")
        return ", ".join(parts)
    return ""


def _as_list(value: Any) -> list[str]:
    """Jaeger keeps array attributes as JSON text; accept that or a real list."""
    if value is None:
        return []
    if isinstance(value, str) and value.startswith("["):
        try:
            return [str(v) for v in json.loads(value)]
        except json.JSONDecodeError:
            return [value]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def format_breakdown(b: Breakdown) -> str:
    """The detailed view of one request."""
    when = datetime.fromtimestamp(b.start_us / 1e6, tz=timezone.utc)
    lines = [
        f"request {b.request_id}  trace {b.trace_id}",
        f"{b.root_name}  at {when:%Y-%m-%d %H:%M:%S.%f}"[:-3] + " UTC",
        f"services: {', '.join(b.services)}",
    ]
    facts = []
    model = b.root_tags.get(tracing.GEN_AI_REQUEST_MODEL)
    if model:
        facts.append(f"model {model}")
    if tracing.GEN_AI_USAGE_INPUT_TOKENS in b.root_tags:
        facts.append(f"{b.root_tags[tracing.GEN_AI_USAGE_INPUT_TOKENS]} prompt tokens")
    if tracing.GEN_AI_USAGE_OUTPUT_TOKENS in b.root_tags:
        facts.append(f"{b.root_tags[tracing.GEN_AI_USAGE_OUTPUT_TOKENS]} output tokens")
    reasons = _as_list(b.root_tags.get(tracing.GEN_AI_RESPONSE_FINISH_REASONS))
    if reasons:
        facts.append(f"finish {', '.join(reasons)}")
    if facts:
        lines.append("; ".join(facts))
    if b.roots > 1:
        lines.append(
            f"warning: {b.roots} spans without a parent in this trace (a parent span was not"
            f" exported?); times are relative to {b.root_name!r}"
        )
    lines.append(f"  {'phase':<12} {'time':>10} {'share':>7}")
    for phase in PHASES:
        if phase in b.phases:
            micros = b.phases[phase]
            note = _phase_note(b, phase)
            row = f"  {phase:<12} {fmt_time(micros):>10} {b.share(micros):>7.1%}"
            lines.append(f"{row}   {note}" if note else row)
        else:
            lines.append(f"  {phase:<12} {'-':>10} {'-':>7}")
    lines.append(f"  {'other':<12} {fmt_time(b.other_us):>10} {b.share(b.other_us):>7.1%}")
    lines.append(f"  {'total':<12} {fmt_time(b.total_us):>10} {1.0 if b.total_us else 0.0:>7.1%}")
    ttft = b.root_tags.get(tracing.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN)
    if ttft is not None:
        lines.append(f"  time to first token {fmt_time(float(ttft) * 1e6)}")
    return "\n".join(lines)


def format_table(rows: list[Breakdown]) -> str:
    """One line per request: each phase's time and share, then the total."""
    columns = [*PHASES, "other"]
    width = max([len("request"), *(len(b.request_id) for b in rows)])
    head = f"{'request':<{width}}  {'start (UTC)':<12}" + "".join(f"  {c:>17}" for c in columns)
    lines = [head + f"  {'total':>10}"]
    for b in rows:
        when = datetime.fromtimestamp(b.start_us / 1e6, tz=timezone.utc).strftime("%H:%M:%S.%f")
        cells = []
        for c in columns:
            micros = b.other_us if c == "other" else b.phases.get(c)
            cell = "-" if micros is None else f"{fmt_time(micros)} {b.share(micros):>6.1%}"
            cells.append(f"  {cell:>17}")
        flag = "  (broken trace)" if b.roots > 1 else ""
        line = (
            f"{b.request_id:<{width}}  {when[:12]:<12}{''.join(cells)}  {fmt_time(b.total_us):>10}"
        )
        lines.append(line + flag)
    if len(rows) > 1:
        # Averages over the listed requests; a phase a request skipped counts as zero for it.
        n = len(rows)
        total = sum(b.total_us for b in rows) / n
        cells = []
        for c in columns:
            if c == "other":
                micros = sum(b.other_us for b in rows) / n
            else:
                micros = sum(b.phases.get(c, 0) for b in rows) / n
            share = micros / total if total > 0 else 0.0
            cells.append(f"  {fmt_time(micros) + f' {share:>6.1%}':>17}")
        lines.append(f"{'mean':<{width}}  {'':<12}{''.join(cells)}  {fmt_time(total):>10}")
    return "\n".join(lines)


def run(ns: argparse.Namespace, out: TextIO | None = None) -> int:
    """``pdserve trace``: 0 on success, 1 when nothing matched, 2 when Jaeger failed."""
    out = out or sys.stdout
    request_id: str | None = getattr(ns, "request_id", None)
    last: int = getattr(ns, "last", 0) or 0
    if request_id is None and last <= 0:
        last = DEFAULT_LAST
    try:
        if request_id is not None:
            traces = fetch_traces(ns.jaeger, ns.service, request_id=request_id, limit=20)
        else:
            traces = fetch_traces(ns.jaeger, ns.service, limit=last)
    except JaegerError as exc:
        print(f"pdserve trace: {exc}", file=sys.stderr)
        return 2
    rows = [breakdown(t) for t in traces if t.get("spans")]
    rows.sort(key=lambda b: b.start_us, reverse=True)  # newest first, like Jaeger's UI
    if not rows:
        what = f"request {request_id}" if request_id is not None else "any request"
        print(
            f"pdserve trace: no trace of {what} for service {ns.service} (not sampled, not yet"
            " exported, or older than Jaeger's search window, 2 days by default?)",
            file=sys.stderr,
        )
        return 1
    if request_id is not None:
        print("\n\n".join(format_breakdown(b) for b in rows), file=out)
    else:
        print(format_table(rows[:last]), file=out)
    return 0
