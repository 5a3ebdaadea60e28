"""The doctor against a running stack: can every decode worker pull from every prefill worker?

Workers are found by their heartbeats on the bus. Each prefill worker is asked for a probe lease
of one block, each decode worker pulls every such lease a few times and reports how long each
pull took and whether the bytes were right, then the leases are released (see
``shared/kv/probe.py``; the workers' side is ``services/probe.py``). The first pull of a pair
includes setting up its UCX endpoint unless the decode worker had already connected. Every
reply carries the worker's UCX warnings and, for TP > 1, each rank's pid and UCX transports
(``services/control/doctor/ranks.py`` reports them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import statistics
import time
from urllib.parse import urlsplit

from nats.errors import NoRespondersError

from pdserve.services.control.doctor.ranks import RankFacts, add_rank_check
from pdserve.services.control.doctor.report import FAIL, INFO, OK, WARN, DoctorInputError, Report
from pdserve.shared.bus.connection import Bus
from pdserve.shared.bus.discovery_messages import WorkerGone, WorkerLoad
from pdserve.shared.bus.lease_messages import ReleaseLease
from pdserve.shared.config import BusConfig
from pdserve.shared.kv.probe import (
    PROBE_PREFIX,
    ProbeLeaseReply,
    ProbeLeaseRequest,
    ProbePullReply,
    ProbePullRequest,
    probe_subject,
    request,
)

PROBE_PULLS = 3
PROBE_TTL = 15.0
MAX_PAIR_LINES = 4  # beyond this many worker pairs, successful pulls share one line
MAX_WORKER_LINES = 8


def reachable(nats_url: str, timeout: float) -> None:
    """Fail fast, with the reason, when no NATS server of ``nats_url`` accepts a TCP connection
    (nats-py itself would retry until the timeout and then say little)."""
    reasons = []
    for server in (s.strip() for s in nats_url.split(",") if s.strip()):
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        try:
            host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        except ValueError as exc:
            raise DoctorInputError(f"bad NATS URL {server!r}: {exc}") from None
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return
        except OSError as exc:
            reasons.append(f"{host}:{port} ({exc.strerror or exc})")
    raise DoctorInputError(f"cannot reach NATS at {nats_url}: {'; '.join(reasons)}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


class StackCheck:
    """One doctor's session with a running stack."""

    def __init__(self, config: BusConfig, timeout: float) -> None:
        self.config = config
        self.timeout = timeout
        self.bus = Bus(config, f"doctor-{os.getpid()}")
        self.loads: dict[str, WorkerLoad] = {}
        self.warnings: dict[str, tuple[str, ...]] = {}  # worker id -> its transport warnings
        self.ranks: dict[str, RankFacts] = {}  # worker id -> its TP ranks' pids and transports
        self.listening_since = 0.0

    async def connect(self) -> None:
        """Connect and start listening for heartbeats (raises DoctorInputError if unreachable)."""
        reachable(self.config.nats_url, self.timeout)
        try:
            await self.bus.connect(timeout=self.timeout)
        except (ConnectionError, PermissionError) as exc:
            raise DoctorInputError(str(exc)) from None
        await self.bus.subscribe(
            self.bus.subjects.all_loads, self._on_load, (WorkerLoad, WorkerGone)
        )
        self.listening_since = time.monotonic()

    async def _on_load(self, msg: WorkerLoad | WorkerGone, headers: dict[str, str]) -> None:
        if isinstance(msg, WorkerGone) or msg.draining:
            self.loads.pop(msg.worker_id, None)
        else:
            self.loads[msg.worker_id] = msg

    async def close(self) -> None:
        await self.bus.close()

    async def run(self, report: Report, discover_seconds: float) -> None:
        await asyncio.sleep(max(0.0, self.listening_since + discover_seconds - time.monotonic()))
        prefill = sorted(w for w, ld in self.loads.items() if ld.role == "prefill")
        decode = sorted(w for w, ld in self.loads.items() if ld.role == "decode")
        where = f"{self.config.nats_url} (namespace {self.config.namespace})"
        details = [
            f"{w}: {ld.role}, model {ld.model}, {ld.free_blocks}/{ld.total_blocks} blocks free, "
            f"{ld.running} running, {ld.waiting} waiting"
            for w, ld in sorted(self.loads.items())
        ]
        if len(details) > MAX_WORKER_LINES:
            details[MAX_WORKER_LINES - 1 :] = [
                f"... and {len(details) - MAX_WORKER_LINES + 1} more"
            ]
        if not decode:
            report.add(
                "stack",
                FAIL,
                f"no decode worker heard in {discover_seconds:g}s on {where}",
                details,
            )
            return
        report.add(
            "stack",
            OK,
            f"{len(prefill)} prefill, {len(decode)} decode worker(s) on {where}",
            details,
        )
        if not prefill:
            report.add("KV pulls", INFO, "no prefill worker: aggregated serving, no KV transfer")
            return
        leases = await self._lease_probes(report, prefill)
        try:
            await self._pull_probes(report, decode, leases)
            self.add_worker_warnings(report)
            add_rank_check(report, self.ranks)
        finally:
            for worker_id, lease in leases.items():
                with contextlib.suppress(Exception):
                    await self.bus.publish(
                        self.bus.subjects.lease(worker_id), ReleaseLease(bus_id=lease.probe_id)
                    )
            with contextlib.suppress(Exception):
                await self.bus.flush()

    async def _ask(self, worker_id: str, msg: object, reply_type: type, timeout: float):
        """A worker's reply, or the reason there is none."""
        try:
            subject = probe_subject(self.bus.subjects, worker_id)
            return await request(self.bus, subject, msg, reply_type, timeout)
        except NoRespondersError:
            return f"{worker_id} does not answer probes (a pdserve without doctor support?)"
        except asyncio.TimeoutError:
            return f"{worker_id} did not answer within {timeout:g}s"
        except Exception as exc:
            return f"{worker_id}: {type(exc).__name__}: {exc}"

    async def _lease_probes(self, report: Report, prefill: list[str]) -> dict[str, ProbeLeaseReply]:
        leases: dict[str, ProbeLeaseReply] = {}
        tag = secrets.token_hex(4)
        for i, worker_id in enumerate(prefill):
            ask = ProbeLeaseRequest(probe_id=f"{PROBE_PREFIX}{tag}-{i}", ttl=PROBE_TTL)
            reply = await self._ask(worker_id, ask, ProbeLeaseReply, self.timeout)
            if isinstance(reply, str):
                report.add("probe lease", FAIL, reply)
                continue
            self._heard(worker_id, reply)
            if reply.status != "ok" or reply.kv is None:
                status = WARN if reply.status == "refused" else FAIL
                report.add("probe lease", status, f"{worker_id} refused: {reply.error}")
            else:
                leases[worker_id] = reply
        return leases

    async def _pull_probes(
        self, report: Report, decode: list[str], leases: dict[str, ProbeLeaseReply]
    ) -> None:
        fine: list[tuple[str, ProbePullReply]] = []
        for worker_id in decode:
            for source, lease in leases.items():
                ask = ProbePullRequest(
                    probe_id=lease.probe_id, kv=lease.kv, pulls=PROBE_PULLS, timeout=self.timeout
                )
                wait = PROBE_PULLS * self.timeout + self.timeout
                reply = await self._ask(worker_id, ask, ProbePullReply, wait)
                pair = f"{worker_id} <- {source}"
                if isinstance(reply, str):
                    report.add("KV pull", FAIL, f"{pair}: {reply}")
                    continue
                self._heard(worker_id, reply)
                if reply.status != "ok":
                    status = WARN if reply.status == "refused" else FAIL
                    report.add("KV pull", status, f"{pair}: {reply.status}: {reply.error}")
                else:
                    fine.append((pair, reply))
        if len(fine) <= MAX_PAIR_LINES:
            for pair, reply in fine:
                first, then = _times(reply)
                report.add(
                    "KV pull",
                    OK,
                    f"{pair}: first {_ms(first)}, then {_ms(then)} (median), "
                    f"1 block of {reply.num_bytes} bytes, bytes verified",
                )
        elif fine:
            firsts, thens = zip(*(_times(reply) for _, reply in fine), strict=True)
            report.add(
                "KV pull",
                OK,
                f"{len(fine)} worker pairs, bytes verified: first pull {_ms(min(firsts))}-"
                f"{_ms(max(firsts))}, then {_ms(min(thens))}-{_ms(max(thens))}",
            )

    def _heard(self, worker_id: str, reply: ProbeLeaseReply | ProbePullReply) -> None:
        """What a worker's probe reply says about its transports, whatever its status."""
        self.warnings[worker_id] = tuple(reply.warnings)
        self.ranks[worker_id] = (list(reply.rank_pids), list(reply.rank_transports))

    def add_worker_warnings(self, report: Report) -> None:
        """Transport warnings workers sent along, once per distinct set (a cluster built from
        one image repeats the same ones on every worker)."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for worker_id, found in sorted(self.warnings.items()):
            if found:
                groups.setdefault(found, []).append(worker_id)
        for found, workers in groups.items():
            report.add("worker UCX", WARN, f"!! on {_few(workers)}", list(found))


def _times(reply: ProbePullReply) -> tuple[float, float]:
    """The first pull (it may set up the endpoint) and the median of the rest."""
    rest = reply.pull_seconds[1:] or reply.pull_seconds
    return reply.pull_seconds[0], statistics.median(rest)


def _few(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
