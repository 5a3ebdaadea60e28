"""A mixed fault schedule under steady load on 2P2D (#47): does every request end, with the right
tokens, and does every KV block come back?

Steady load: ``--clients`` streams at a time, greedy (temperature 0, ``ignore_eos``), prompts
from a fixed set, some long enough to be pulled layer by layer (``--kv-stream-threshold 256``).
The answer to each prompt is first taken on the undisturbed stack; under faults every completed
stream is compared with it. The faults, evenly spread over ``--duration``:

    abort storm      ``--clients`` extra streams hung up at random moments
    kill prefill     SIGKILL of p0, restarted 2 s later under the same id (a supervisor)
    kill decode      SIGKILL of d0 (its streams migrate), restarted 2 s later
    nats restart     a NATS node down for 1 s, on the same port (on the hosts: host a's, the
                     gateway's, p0's and d0's, whose clients fail over to the other two)
    partition decode d1's host loses its network link for ``--outage`` s (10), then gets it back
    partition prefill p1's host the same

The partitions are real: the stack runs on network-namespace "hosts" on one bridge
(tests/multihost/chaos_hosts.py: p0, d0 and the gateway on host a, d1 on b, p1 on c, one NATS
node each, clustered; KV and NATS cross the bridge on 198.18.0.0/15 addresses), and a partition
takes the host's veth end on the bridge down - its processes run on, unreachable. That needs
root and ``ip netns``; without them the stack runs in the root namespace, the partition faults
are left out of the schedule and the report says so and why (``partition``). ``stall decode``
(SIGSTOP of d1 for ``--outage`` s, then SIGCONT: the worker falls silent but its sockets stay
up) is not a partition and runs only when ``--faults`` names it.

Reports (``--out``, JSON): requests completed, failed with a clean error (an HTTP error or an
error event), hung (no end within ``--hang-seconds``), aborted on purpose; streams whose text
differs from the reference and their tokens lost or duplicated (chunks against the reference's);
KV blocks still held at the end; per fault the completions per second in the window before and
after (``--window``, default a minute scaled to the schedule) and the recovery time (fault to the
end of the last 2 s, before the next fault, with less than half the before rate of completions); the worst
recovery.

    .venv/bin/python -m perf.chaos_bench --duration 600   # the 10-minute form
    .venv/bin/python -m perf.chaos_bench --duration 90    # the CI form (tests/integration)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tests.integration.chaos_stack import ChaosStack
from tests.multihost import netns
from tests.multihost.chaos_hosts import NetnsChaosStack

FAULTS = (
    "abort_storm",
    "kill_prefill",
    "kill_decode",
    "nats_restart",
    "partition_decode",
    "partition_prefill",
)
PARTITIONS = {"partition_decode": "d1", "partition_prefill": "p1"}  # fault -> worker cut off
OPTIONAL = ("stall_decode",)
WORKER_OPTIONS = {"kv_stream_threshold": 256, "kv_pull_timeout": 3.0, "num_kv_blocks": 256}
RESTART_AFTER = 2.0  # a supervisor's delay before it starts a killed worker again
MAX_TOKENS = 24
BIN = 2.0  # seconds: the grain of the recovery time


@dataclass
class Outcome:
    start: float
    end: float = 0.0
    kind: str = "hung"  # completed, error, hung, aborted
    prompt: int = 0
    text: str = ""
    chunks: int = 0
    error: str = ""


@dataclass
class Run:
    base: str
    model: str
    prompts: list[list[int]]
    hang_seconds: float
    reference: dict[int, tuple[str, int]] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[str, float]] = field(default_factory=list)
    schedule: tuple[str, ...] = FAULTS
    outage: float = 10.0  # seconds a partition (or stall) lasts
    partition: str = ""  # how partitions were made, or why they were left out


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [24, 96, 180, 300]  # local prefill is below 6: all of these are disaggregated
    return [
        [rng.randrange(20, 380) for _ in range(lengths[i % len(lengths)])] for i in range(count)
    ]


async def one(
    session: aiohttp.ClientSession, run: Run, prompt: int, hang_up_after: float | None = None
) -> Outcome:
    out = Outcome(start=time.monotonic(), prompt=prompt)
    body = {
        "model": run.model,
        "prompt": run.prompts[prompt],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        await asyncio.wait_for(_read(session, run, body, out), hang_up_after or run.hang_seconds)
    except TimeoutError:
        out.kind = "aborted" if hang_up_after else "hung"
    except aiohttp.ClientError as exc:
        out.kind, out.error = "error", repr(exc)[:200]
    finally:
        out.end = time.monotonic()
        run.outcomes.append(out)
    return out


async def _read(session: aiohttp.ClientSession, run: Run, body: dict, out: Outcome) -> None:
    async with session.post(f"{run.base}/v1/completions", json=body) as r:
        if r.status != 200:
            out.kind, out.error = "error", f"HTTP {r.status}: {(await r.text())[:200]}"
            return
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.kind, out.error = "error", str(chunk["error"])[:200]
                return
            out.text += chunk["choices"][0]["text"]
            out.chunks += 1
    out.kind = "completed"


async def steady(session: aiohttp.ClientSession, run: Run, client: int, stop: float) -> None:
    i = client
    while time.monotonic() < stop:
        await one(session, run, i % len(run.prompts))
        i += 1


async def inject(stack: ChaosStack, run: Run, session: aiohttp.ClientSession, fault: str) -> None:
    run.faults.append((fault, time.monotonic()))
    print(f"[{time.strftime('%X')}] fault: {fault}", flush=True)
    if fault == "abort_storm":
        rng = random.Random(len(run.faults))
        hangs = [
            one(session, run, rng.randrange(len(run.prompts)), rng.uniform(0.05, 1.5))
            for _ in range(4 * len(run.prompts))
        ]
        await asyncio.gather(*hangs)
    elif fault in ("kill_prefill", "kill_decode"):
        name = "p0" if fault == "kill_prefill" else "d0"
        stack.children[name].signal(signal.SIGKILL)
        await asyncio.to_thread(stack.children[name].wait, 10)
        await asyncio.sleep(RESTART_AFTER)
        stack.start_worker(name)
        await asyncio.to_thread(stack.wait_ready)
    elif fault == "nats_restart":
        assert stack.nats is not None
        await asyncio.to_thread(stack.nats.restart, 1.0)
    elif fault in PARTITIONS:
        assert isinstance(stack, NetnsChaosStack)
        stack.partition(PARTITIONS[fault], down=True)
        try:
            await asyncio.sleep(run.outage)
        finally:
            stack.partition(PARTITIONS[fault], down=False)
    elif fault == "stall_decode":
        stack.children["d1"].signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(run.outage)
        finally:
            stack.children["d1"].signal(signal.SIGCONT)


async def reference(session: aiohttp.ClientSession, run: Run) -> None:
    for i in range(len(run.prompts)):
        out = await one(session, run, i)
        assert out.kind == "completed", f"reference {i}: {out}"
        run.reference[i] = (out.text, out.chunks)
    run.outcomes.clear()


async def drive(stack: ChaosStack, run: Run, args: argparse.Namespace) -> float:
    async with aiohttp.ClientSession() as session:
        await reference(session, run)
        t0 = time.monotonic()
        stop = t0 + args.duration
        load = [asyncio.create_task(steady(session, run, c, stop)) for c in range(args.clients)]
        spacing = args.duration / (len(run.schedule) + 1)
        faults = []  # each on time, whether or not the one before has recovered
        for k, fault in enumerate(run.schedule, 1):
            await asyncio.sleep(max(0.0, t0 + k * spacing - time.monotonic()))
            faults.append(asyncio.create_task(inject(stack, run, session, fault)))
        await asyncio.gather(*load, *faults)
    return t0


def rate(outcomes: list[Outcome], lo: float, hi: float) -> float:
    done = sum(1 for o in outcomes if o.kind == "completed" and lo <= o.end < hi)
    return done / max(hi - lo, 1e-9)


def recovery(outcomes: list[Outcome], at: float, hi: float, before: float) -> float | None:
    """Seconds from the fault to the end of the last ``BIN`` before ``hi`` with fewer than half
    the completions per second of before it: from then on the rate held. None: not back by
    ``hi``."""
    bins = [at + BIN * k for k in range(int((hi - at) / BIN))]
    slow = [s for s in bins if rate(outcomes, s, s + BIN) < 0.5 * before]
    if not slow:
        return 0.0
    if slow[-1] == bins[-1] and len(bins) > 1:
        return None
    return slow[-1] + BIN - at


def summarize(stack: ChaosStack, run: Run, args: argparse.Namespace, t0: float) -> dict:
    spacing = args.duration / (len(run.schedule) + 1)
    window = args.window or min(60.0, spacing / 2)
    kinds = {k: 0 for k in ("completed", "error", "hung", "aborted")}
    wrong, lost, duplicated, errors = 0, 0, 0, []
    for o in run.outcomes:
        kinds[o.kind] += 1
        if o.kind == "error" and len(errors) < 10:
            errors.append(o.error)
        if o.kind == "completed":
            text, chunks = run.reference[o.prompt]
            if o.text != text:
                wrong += 1
                lost += max(0, chunks - o.chunks)
                duplicated += max(0, o.chunks - chunks)
    faults = []
    end = t0 + args.duration
    for name, at in run.faults:
        before = rate(run.outcomes, max(t0, at - window), at)
        after = rate(run.outcomes, at, min(end, at + window))
        # Recovery is looked for up to the next fault, not within the rate window: a fault can
        # last longer than the window (a 10 s partition, against the short form's 7.5 s).
        recovered = recovery(run.outcomes, at, min(end, at + spacing), before)
        faults.append(
            {
                "fault": name,
                "at_s": round(at - t0, 1),
                "completions_per_s_before": round(before, 2),
                "completions_per_s_after": round(after, 2),
                "after_over_before": round(after / before, 2) if before else None,
                "recovery_s": None if recovered is None else round(recovered, 1),
            }
        )
    leaked = blocks_leaked(stack)
    recoveries = [f["recovery_s"] for f in faults]
    return {
        "duration_s": args.duration,
        "clients": args.clients,
        "window_s": round(window, 1),
        "requests": kinds,
        "streams_differing_from_reference": wrong,
        "tokens_lost": lost,
        "tokens_duplicated": duplicated,
        "blocks_leaked": leaked,
        "faults": faults,
        "worst_recovery_s": None if None in recoveries else max(recoveries, default=0.0),
        "unrecovered_faults": sum(r is None for r in recoveries),
        "sample_errors": errors,
        "partition": run.partition,
        # completions per second in each BIN from the start: what each fault did, to the eye
        "timeline_per_s": [
            round(rate(run.outcomes, t0 + lo, t0 + lo + BIN), 1)
            for lo in (BIN * k for k in range(int(args.duration / BIN)))
        ],
    }


def blocks_leaked(stack: ChaosStack) -> float:
    try:
        stack.wait_idle(30)
        return 0.0
    except AssertionError:
        return sum(h.blocks for h in stack.held().values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load under faults")
    p.add_argument("--clients", type=int, default=4, help="streams at a time")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--window", type=float, default=0.0, help="throughput window; 0: scaled")
    p.add_argument("--hang-seconds", type=float, default=90.0)
    p.add_argument("--model", default="", help="a checkpoint folder; default: the tiny llama")
    p.add_argument("--out", default="perf/results/chaos_bench.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"the schedule, in order (comma-separated; also: {', '.join(OPTIONAL)})",
    )
    p.add_argument("--outage", type=float, default=10.0, help="seconds a partition lasts")
    p.add_argument("--logs", default="", help="keep every process's log in this folder")
    args = p.parse_args(argv)
    schedule, note = plan(args.faults, args.outage)
    print(f"chaos_bench: {note}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="chaos-bench-") as tmp:
        model = args.model
        if not model:
            from tests.checkpoints import build_checkpoint

            model = str(build_checkpoint("llama-gqa", Path(tmp) / "ckpt"))
        on_hosts = any(f in PARTITIONS for f in schedule)
        stack = (NetnsChaosStack if on_hosts else ChaosStack)(
            Path(args.logs) if args.logs else Path(tmp) / "logs",
            model,
            prefill=("p0", "p1"),
            decode=("d0", "d1"),
            worker_options=WORKER_OPTIONS,
        )
        try:
            stack.start()
            stack.wait_ready()
            run = Run(
                base=stack.base,
                model=Path(model).name,
                prompts=make_prompts(args.prompts, args.seed),
                hang_seconds=args.hang_seconds,
                schedule=schedule,
                outage=args.outage,
                partition=note,
            )
            run.model = served_model(stack.base)
            t0 = asyncio.run(drive(stack, run, args))
            result = summarize(stack, run, args, t0)
        except BaseException:
            print(stack.tail(), file=sys.stderr)
            raise
        finally:
            stack.stop()
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ok = not result["requests"]["hung"] and not result["blocks_leaked"]
    ok = ok and not result["streams_differing_from_reference"]
    return 0 if ok else 1


def plan(faults: str, outage: float) -> tuple[tuple[str, ...], str]:
    """The schedule to run and the report's line on partitions: real ones need root and
    ``ip netns``; without them they are left out, said so, never replaced by a stand-in."""
    schedule = tuple(f.strip() for f in faults.split(",") if f.strip())
    unknown = [f for f in schedule if f not in FAULTS + OPTIONAL]
    if unknown:
        raise SystemExit(f"unknown faults {unknown}: choose from {FAULTS + OPTIONAL}")
    wanted = [f for f in schedule if f in PARTITIONS]
    if not wanted:
        return schedule, "none in the schedule"
    reason = netns.unavailable_reason()
    if reason is not None:
        kept = tuple(f for f in schedule if f not in PARTITIONS)
        return kept, f"left out ({', '.join(wanted)}): {reason}"
    cut = ", ".join(f"{f}: {PARTITIONS[f]}'s host" for f in wanted)
    return schedule, f"real: the host's veth on the bridge down for {outage:g} s ({cut})"


def served_model(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
