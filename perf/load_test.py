"""Load run: many concurrent streams against ``pdserve up`` 1P1D with bounded admission.

pdserve promises that every accepted request completes or ends with an explicit error within its
deadline, that admission is bounded (``--max-queue``: beyond it a 503 with ``Retry-After``), and
that no KV block leaks. This script starts ``pdserve up`` (demo model, one prefill and one decode
worker), fires ``--streams`` streaming completions at once, ``--waves`` times over, and checks:

- every stream either completes (a chunk with ``finish_reason``, then ``data: [DONE]``) or is
  refused with a 503 that carries ``Retry-After``; nothing else, and at least one completes;
- none hangs: each has its own client timeout, and a timed-out stream is a violation;
- memory stays bounded: RSS of the gateway and of each worker before, at peak and after each
  wave; total growth beyond ``--rss-growth-mib`` is a violation, and so is RSS still climbing
  over the later half of the waves by more than ``--leak-kib-per-request``. The gateway's RSS
  climbs for ~20 waves of 500 (caches, allocator) before it levels off, so fewer waves cannot
  tell warm-up from a leak;
- no leak: after every wave ``pdserve_kv_cache_used_blocks`` on the gateway's ``/metrics``
  returns to 0 for every worker, and ``pdserve_requests_in_flight`` to 0.

Writes a JSON result and a markdown summary; exits 1 on any violation.

    python -m perf.load_test [--streams 500] [--waves 30] [--max-queue 256]
                             [--json PATH] [--md PATH] [-- more pdserve up options]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.control.processes import free_port

READY_TIMEOUT = 300.0
SETTLE_TIMEOUT = 60.0  # for the block gauges to return to 0
HEARTBEAT = 0.5  # workers' load period (--heartbeat-seconds default): the gauges' refresh
WORKERS = 2  # one prefill, one decode
WORDS = "the of and to in is was for on that with as by at from his her it an are".split()


@dataclass
class StreamResult:
    index: int
    outcome: str = "pending"  # completed | rejected_503 | error | timeout
    status: int = 0
    detail: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class ProcessMemory:
    name: str
    pid: int
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    rss_after_wave_mib: list[float] = field(default_factory=list)

    @property
    def growth_mib(self) -> float:
        return self.rss_after_mib - self.rss_before_mib

    def late_growth_kib_per_request(self, streams: int) -> float | None:
        """RSS growth per request fired: the least-squares slope over the second half of the
        waves, when allocator arenas and caches have warmed up. A steady leak shows here, a
        one-off step in RSS much less."""
        late = self.rss_after_wave_mib[(len(self.rss_after_wave_mib) - 1) // 2 :]
        if len(late) < 3:
            return None
        mib_per_wave = statistics.linear_regression(range(len(late)), late).slope
        return mib_per_wave * 1024 / streams


@dataclass
class Wave:
    """One burst of streams and the state the stack settled to afterwards."""

    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    used_blocks_after: dict[str, float] = field(default_factory=dict)
    in_flight_after: float | None = None
    settle_seconds: float | None = None


@dataclass
class Report:
    streams: int
    waves: int
    max_queue: int
    max_tokens: int
    request_timeout: float
    outcomes: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    e2e_p50_s: float | None = None
    e2e_max_s: float | None = None
    memory: list[ProcessMemory] = field(default_factory=list)
    wave_log: list[Wave] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    samples: list[StreamResult] = field(default_factory=list)  # first few non-completed ones


# ---------------------------------------------------------------------------------------------
# processes


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def service_pids(launcher_pid: int) -> dict[str, int]:
    """The launcher's children by role: gateway, prefill, decode, nats (from /proc)."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        for role in ("gateway", "prefill", "decode"):
            if "pdserve.cli" in argv and role in argv:
                found[role] = int(entry)
        if any(a.endswith("nats-server") for a in argv):
            found["nats"] = int(entry)
    return found


class Stack:
    """``pdserve up`` 1P1D as a child process, output to a log file, stopped by its pid."""

    def __init__(
        self,
        port: int,
        max_queue: int,
        request_timeout: float,
        log_path: Path,
        extra: list[str] | None = None,
    ) -> None:
        self.port = port
        self.log_path = log_path
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            "demo",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--port",
            str(port),
            "--max-queue",
            str(max_queue),
            "--request-timeout",
            str(request_timeout),
            *(extra or []),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        # one torch thread per service: the load, not intra-op threads, should fill the cores
        env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.update(UCX_WARN_UNUSED_ENV_VARS="n")
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while "pdserve ready at" not in self.log_path.read_text(errors="replace"):
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"pdserve up exited with {self.popen.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve up not ready after {READY_TIMEOUT:.0f}s")
            time.sleep(0.2)

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> int:
        """SIGTERM to the launcher (it stops its services and NATS), SIGKILL if it hangs."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.log.close()
        return self.popen.returncode


class RssSampler(threading.Thread):
    """Peak RSS of each process, sampled every ``interval`` seconds while the load runs."""

    def __init__(self, memory: list[ProcessMemory], interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.memory = memory
        self.interval = interval
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            for m in self.memory:
                try:
                    m.rss_peak_mib = max(m.rss_peak_mib, rss_mib(m.pid))
                except OSError:
                    pass  # a dead service shows up as a violation elsewhere


# ---------------------------------------------------------------------------------------------
# client


async def one_stream(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    index: int,
    max_tokens: int,
    timeout: float,
    rng: random.Random,
) -> StreamResult:
    result = StreamResult(index)
    body = {
        "model": model,
        "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))),
        "max_tokens": rng.randint(1, max_tokens),
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                result.status = resp.status
                if resp.status == 503:
                    text = await resp.text()
                    if "Retry-After" in resp.headers:
                        result.outcome = "rejected_503"
                    else:
                        result.outcome, result.detail = "error", f"503 without Retry-After: {text}"
                elif resp.status != 200:
                    result.outcome, result.detail = "error", (await resp.text())[:300]
                else:
                    await read_stream(resp, result)
    except TimeoutError:
        result.outcome, result.detail = "timeout", f"no end of stream within {timeout:.0f}s"
    except aiohttp.ClientError as exc:
        result.outcome, result.detail = "error", repr(exc)[:300]
    result.seconds = time.perf_counter() - t0
    return result


async def read_stream(resp: aiohttp.ClientResponse, result: StreamResult) -> None:
    done = False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            result.outcome, result.detail = "error", json.dumps(event["error"])[:300]
            return
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            result.tokens = event["usage"].get("completion_tokens", 0)
    if done and result.finish_reason:
        result.outcome = "completed"
    else:
        result.outcome = "error"
        result.detail = "stream ended without " + ("finish_reason" if done else "[DONE]")


async def fire(
    url: str, model: str, streams: int, max_tokens: int, timeout: float, seed: int
) -> list[StreamResult]:
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)  # every stream gets its own connection at once
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [
            one_stream(session, url, model, i, max_tokens, timeout, random.Random(rng.random()))
            for i in range(streams)
        ]
        return await asyncio.gather(*tasks)


# ---------------------------------------------------------------------------------------------
# checks


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def served_model(url: str) -> str:
    return json.loads(get_text(f"{url}/v1/models"))["data"][0]["id"]


def gauges(url: str) -> tuple[dict[str, float], float | None]:
    """``pdserve_kv_cache_used_blocks`` per worker, and ``pdserve_requests_in_flight``."""
    used: dict[str, float] = {}
    in_flight = None
    for family in text_string_to_metric_families(get_text(f"{url}/metrics")):
        for sample in family.samples:
            if sample.name == "pdserve_kv_cache_used_blocks":
                used[sample.labels["worker"]] = sample.value
            elif sample.name == "pdserve_requests_in_flight":
                in_flight = sample.value
    return used, in_flight


def wait_settled(url: str, workers: int, wave: Wave) -> None:
    """Poll the gateway until every worker's KV gauge and the in-flight gauge read 0 on two
    reads a heartbeat apart (or SETTLE_TIMEOUT passes); record what was last seen."""
    t0 = time.monotonic()
    time.sleep(2 * HEARTBEAT)  # never judge by a heartbeat sent before the load ended
    zero_reads = 0
    while zero_reads < 2 and time.monotonic() - t0 < SETTLE_TIMEOUT:
        used, in_flight = gauges(url)
        wave.used_blocks_after, wave.in_flight_after = used, in_flight
        zero = len(used) == workers and not any(used.values()) and not in_flight
        zero_reads = zero_reads + 1 if zero else 0
        time.sleep(HEARTBEAT)
    wave.settle_seconds = time.monotonic() - t0


def judge(
    report: Report,
    results: list[StreamResult],
    workers: int,
    rss_growth_limit: float,
    leak_limit_kib: float,
) -> None:
    report.outcomes = dict(Counter(r.outcome for r in results))
    report.finish_reasons = dict(Counter(r.finish_reason for r in results if r.finish_reason))
    done = [r.seconds for r in results if r.outcome == "completed"]
    if done:
        report.e2e_p50_s, report.e2e_max_s = statistics.median(done), max(done)
    bad = [r for r in results if r.outcome not in ("completed", "rejected_503")]
    report.samples = bad[:10]
    for outcome in ("error", "timeout"):
        if report.outcomes.get(outcome):
            report.violations.append(f"{report.outcomes[outcome]} streams ended as {outcome}")
    if not done:
        report.violations.append("no stream completed")
    for n, wave in enumerate(report.wave_log, 1):
        used = wave.used_blocks_after
        if len(used) != workers:
            report.violations.append(f"wave {n}: {len(used)} workers on /metrics, not {workers}")
        for worker, blocks in used.items():
            if blocks:
                report.violations.append(
                    f"wave {n}: {worker} still holds {blocks:g} KV blocks "
                    f"{wave.settle_seconds:.0f}s after the wave"
                )
        if wave.in_flight_after:
            report.violations.append(
                f"wave {n}: gateway reports {wave.in_flight_after:g} requests in flight after it"
            )
    for m in report.memory:
        if m.growth_mib > rss_growth_limit:
            report.violations.append(
                f"{m.name} RSS grew {m.growth_mib:.0f} MiB (limit {rss_growth_limit:.0f} MiB)"
            )
        late = m.late_growth_kib_per_request(report.streams)
        if late is not None and late > leak_limit_kib:
            report.violations.append(
                f"{m.name} RSS keeps growing: {late:.1f} KiB per request over the later waves "
                f"(limit {leak_limit_kib:g} KiB)"
            )


def counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def markdown(report: Report, command: str) -> str:
    lines = [
        "# Load run: concurrent streams on pdserve up 1P1D (demo model)",
        "",
        f"Command: `{command}`",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}",
        f"- {report.waves} waves of {report.streams} streams fired at once, "
        f"`--max-queue {report.max_queue}`, up to {report.max_tokens} output tokens each, "
        f"client timeout {report.request_timeout:.0f} s",
        f"- outcomes (all waves): {counts(report.outcomes)}",
        f"- finish reasons: {', '.join(f'{k} {v}' for k, v in report.finish_reasons.items())}",
    ]
    if report.e2e_p50_s is not None:
        lines.append(
            f"- completed streams' latency: median {report.e2e_p50_s:.2f} s, "
            f"max {report.e2e_max_s:.2f} s"
        )
    lines += [
        "",
        "| wave | wall s | outcomes | KV blocks in use after | in flight after | settled in s |",
        "|---:|---:|---|---|---:|---:|",
    ]
    for n, w in enumerate(report.wave_log, 1):
        used = ", ".join(f"{k} {v:g}" for k, v in w.used_blocks_after.items())
        lines.append(
            f"| {n} | {w.seconds:.1f} | {counts(w.outcomes)} | {used} | {w.in_flight_after} "
            f"| {w.settle_seconds:.1f} |"
        )
    lines += [
        "",
        "| process | pid | RSS before (MiB) | peak | after each wave | growth "
        "| later waves, KiB/request |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for m in report.memory:
        waves = " / ".join(f"{v:.0f}" for v in m.rss_after_wave_mib)
        late = m.late_growth_kib_per_request(report.streams)
        lines.append(
            f"| {m.name} | {m.pid} | {m.rss_before_mib:.0f} | {m.rss_peak_mib:.0f} "
            f"| {waves} | {m.growth_mib:+.0f} | {'-' if late is None else f'{late:.2f}'} |"
        )
    lines += ["", "**Verdict:** " + ("PASS" if not report.violations else "FAIL")]
    lines += [f"- {v}" for v in report.violations]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(args.streams, args.waves, args.max_queue, args.max_tokens, args.timeout)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-load-"))
    # the server's own deadline comes first: a stream it gives up on must end with an explicit
    # error the client sees, so the client's timeout only catches real hangs
    server_deadline = 0.8 * args.timeout
    stack = Stack(free_port(), args.max_queue, server_deadline, log_dir / "up.log", args.up_args)
    try:
        stack.wait_ready()
        model = served_model(stack.url)
        # one request first: every service has loaded, compiled and connected before "before"
        (warm,) = asyncio.run(fire(stack.url, model, 1, 4, args.timeout, args.seed + 1))
        if warm.outcome != "completed":
            raise RuntimeError(f"warm-up request ended as {warm.outcome}: {warm.detail}")
        wait_settled(stack.url, WORKERS, Wave())
        pids = service_pids(stack.popen.pid)
        report.memory = [
            ProcessMemory(name, pid) for name, pid in sorted(pids.items()) if name != "nats"
        ]
        for m in report.memory:
            m.rss_before_mib = m.rss_peak_mib = rss_mib(m.pid)
        sampler = RssSampler(report.memory)
        sampler.start()
        results: list[StreamResult] = []
        for n in range(args.waves):
            wave = Wave()
            t0 = time.perf_counter()
            burst = asyncio.run(
                fire(stack.url, model, args.streams, args.max_tokens, args.timeout, args.seed + n)
            )
            wave.seconds = time.perf_counter() - t0
            wave.outcomes = dict(Counter(r.outcome for r in burst))
            results += burst
            wait_settled(stack.url, WORKERS, wave)
            report.wave_log.append(wave)
            for m in report.memory:
                m.rss_after_mib = rss_mib(m.pid)
                m.rss_after_wave_mib.append(m.rss_after_mib)
            print(f"wave {n + 1}: {counts(wave.outcomes)}", file=sys.stderr, flush=True)
        sampler.done.set()
        sampler.join()
        judge(report, results, WORKERS, args.rss_growth_mib, args.leak_kib_per_request)
    except Exception as exc:
        report.violations.append(f"load run failed: {exc!r}")
        print(stack.tail(), file=sys.stderr)
    finally:
        rc = stack.stop()
        if rc != 0:
            report.violations.append(f"pdserve up exited with {rc} on SIGTERM")
    print(f"service logs: {log_dir}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.load_test", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=500, help="concurrent streaming requests")
    p.add_argument("--waves", type=int, default=30, help="bursts of --streams, one after another")
    p.add_argument("--max-queue", type=int, default=256, help="gateway/worker admission bound")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, seconds")
    p.add_argument("--rss-growth-mib", type=float, default=256.0, help="allowed RSS growth")
    p.add_argument(
        "--leak-kib-per-request",
        type=float,
        default=2.0,
        help="allowed RSS growth per request over the later waves (needs 5+ waves)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the result JSON here")
    p.add_argument("--md", type=Path, help="write the markdown summary here")
    p.add_argument(
        "up_args", nargs="*", help="more `pdserve up` options, after --, e.g. -- --no-prefix-cache"
    )
    args = p.parse_args(argv)
    command = "python -m perf.load_test " + " ".join(sys.argv[1:] if argv is None else argv)

    report = run(args, command)
    md = markdown(report, command)
    print(md)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(report)
        data["command"] = command
        for m, d in zip(report.memory, data["memory"], strict=True):
            d["growth_mib"] = m.growth_mib
            d["late_growth_kib_per_request"] = m.late_growth_kib_per_request(report.streams)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
