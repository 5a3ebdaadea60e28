"""KV pull bandwidth between two namespace "hosts", next to raw UCX between the same two.

The hosts are those of ``tests/multihost`` (``tests/multihost/netns.py`` builds them: each
namespace on 198.18.S.0/24 behind a veth pair on a bridge in a namespace of its own, UCX's
shared-memory transports off, as between machines); needs root and ``ip netns``. Host B holds
the prefill side, host C the decode side, and every byte crosses the bridge over UCX TCP:

- **pdserve pull** and **raw ucxx**: ``perf/kv_bench.py`` run on host C with ``--ucx-host``
  its own address and its prefill-side child on host B (``--peer-netns``, ``--peer-host``);
- **ucx_perftest**: UCX's own benchmark from the libucx wheel's ``bin/``, ``-t tag_bw``, server
  on B and client on C, on the same device (``UCX_NET_DEVICES=eth0``), ahead of the pulls in
  every round (median of the rounds);
- **loopback pull**: the same ``perf/kv_bench.py`` in the root namespace on 127.0.0.1 with the
  hosts' environment (shared memory off: UCX TCP over ``lo``), so the two differ only by the
  veth pairs and the bridge. The two pull runs alternate ABBA over ``--rounds``; each case is
  the median over rounds of a run's medians.

Every run logs ``UCX_PROTO_INFO``; the lanes UCX chose for tagged sends are reported, so a run
that did not go over ``tcp/eth0`` (``tcp/lo`` for loopback) shows it.

    python -m perf.netns_kv_bench [--sizes-mib 1 8 64] [--reps 9] [--rounds 2]
        [--json perf/results/netns_kv_bench.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import libucx

from pdserve.services.control.doctor.ucx import parse_ucx_log, tag_send_tables
from tests.multihost import netns
from tests.multihost.netns import Host

ROOT = Path(__file__).resolve().parents[1]
UCX_DIR = Path(libucx.__file__).resolve().parent
MIB = 1 << 20


def lanes(log_dir: Path, pattern: str) -> list[str]:
    """'scope: lanes' of the tagged-send protocol tables UCX logged into ``log_dir``."""
    text = "\n".join(p.read_text(errors="replace") for p in log_dir.glob(pattern))
    tables = tag_send_tables(parse_ucx_log(text)[0])
    return sorted({f"{t.scope}: {' '.join(sorted(t.lanes()))}" for t in tables})


def proto_env(log_dir: Path, name: str) -> list[str]:
    return ["env", "UCX_PROTO_INFO=y", f"UCX_LOG_FILE={log_dir / name}.%p.log"]


def kv_bench(
    prefix: list[str], host_args: list[str], sizes: list[float], reps: int, logs: Path, name: str
) -> dict:
    """One ``perf/kv_bench.py`` run under ``prefix`` (a host's ``argv``, or plain ``env``)."""
    result = logs / f"{name}.json"
    argv = [
        *prefix,
        *proto_env(logs, name)[1:],
        sys.executable,
        "-m",
        "perf.kv_bench",
        *host_args,
        "--sizes-mib",
        *(f"{s:g}" for s in sizes),
        "--reps",
        str(reps),
        "--json",
        str(result),
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"kv_bench ({name}) failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(result.read_text())


def pdserve_pull(b: Host, c: Host, sizes: list[float], reps: int, logs: Path, round_: int) -> dict:
    """Decode side on host C, prefill side on host B: across the bridge."""
    peer = ["--ucx-host", c.address, "--peer-netns", b.netns, "--peer-host", b.address]
    return kv_bench(c.argv(), peer, sizes, reps, logs, f"kv_bench-{round_}")


def loopback_pull(sizes: list[float], reps: int, logs: Path, round_: int) -> dict:
    """Both sides in this (the root) namespace on 127.0.0.1, with the hosts' ``HOST_ENV``: the
    same UCX TCP transport over ``lo``, so the difference is what the veth pairs and the bridge
    cost."""
    prefix = ["env", *(f"{k}={v}" for k, v in netns.HOST_ENV.items())]
    return kv_bench(prefix, ["--ucx-host", "127.0.0.1"], sizes, reps, logs, f"loopback-{round_}")


def perftest(b: Host, c: Host, size: int, logs: Path, port: int = 13337) -> float:
    """GB/s of one ``ucx_perftest -t tag_bw`` run from B to C (its overall bandwidth)."""
    iters = max(10, (256 * MIB) // size)
    args = ["-t", "tag_bw", "-s", str(size), "-n", str(iters), "-w", str(max(2, iters // 10))]
    env = ["env", f"LD_LIBRARY_PATH={UCX_DIR / 'lib'}", "UCX_NET_DEVICES=eth0"]
    binary = str(UCX_DIR / "bin" / "ucx_perftest")
    server = subprocess.Popen(
        b.argv(*env, binary, *args, "-p", str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client_argv = c.argv(
        *env, *proto_env(logs, "perftest")[1:], binary, b.address, *args, "-p", str(port), "-f"
    )
    served = ""
    try:
        _until_listening(server, port, timeout=30)
        client = subprocess.run(client_argv, capture_output=True, text=True, timeout=600)
        served += server.communicate(timeout=60)[0]
    finally:
        if server.poll() is None:
            server.kill()
            served += server.communicate()[0]
    # -f: one row of numbers under the table's header: iterations, latency (50th percentile,
    # average, overall), bandwidth MB/s (average, overall), message rate (average, overall)
    final = [ln.split() for ln in client.stdout.splitlines() if _numbers(ln.split(), 8)]
    if client.returncode != 0 or not final:
        raise RuntimeError(
            f"ucx_perftest failed:\n{client.stdout}\n{client.stderr}\nserver:\n{served}"
        )
    return float(final[-1][5]) * MIB / 1e9  # perftest's MB is 2**20 bytes


def _until_listening(server: subprocess.Popen, port: int, timeout: float) -> None:
    """Until ``server`` listens on ``port``, read from its namespace's TCP table (its own pid:
    ``ip netns exec`` and ``env`` exec it). A client started earlier is refused, and one that
    gives up leaves the server waiting forever; its output is block-buffered, so no use."""
    table = Path(f"/proc/{server.pid}/net/tcp")
    listening = f":{port:04X} 00000000:0000 0A "  # local port, no remote end, state LISTEN
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        with contextlib.suppress(OSError):
            if listening in table.read_text():
                return
        time.sleep(0.05)
    raise RuntimeError(f"ucx_perftest's server never listened on port {port}")


def _numbers(words: list[str], count: int) -> bool:
    try:
        return len(words) == count and all(float(w) >= 0 for w in words)
    except ValueError:
        return False


def markdown(cases: list[dict], loop: list[dict], raw: dict[float, list[float]]) -> str:
    lines = [
        "| size | pattern | pull GB/s | raw ucxx GB/s | pull/raw | ucx_perftest GB/s "
        "| pull/perftest | loopback pull GB/s | pull/loopback |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    loopback = {(c["size_mib"], c["pattern"]): c["pull_gbps"] for c in loop}
    for c in cases:
        ucx = statistics.median(raw[min(raw, key=lambda mib: abs(mib - c["size_mib"]))])
        lo = loopback[c["size_mib"], c["pattern"]]
        lines.append(
            f"| {c['size_mib']:g} MiB | {c['pattern']} | {c['pull_gbps']:.2f} "
            f"| {c['raw_gbps']:.2f} | {c['ratio']:.2f}x | {ucx:.2f} "
            f"| {c['pull_gbps'] / ucx:.2f}x | {lo:.2f} | {c['pull_gbps'] / lo:.2f}x |"
        )
    return "\n".join(lines)


def merged(runs: list[dict]) -> list[dict]:
    """One case per (size, pattern): the median over rounds of each run's medians."""
    by_case: dict[tuple[float, str], list[dict]] = {}
    for run in runs:
        for case in run["cases"]:
            by_case.setdefault((case["size_mib"], case["pattern"]), []).append(case)
    return [
        {
            "size_mib": size,
            "pattern": pattern,
            **{k: statistics.median(c[k] for c in cases) for k in ("pull_gbps", "raw_gbps")},
            "ratio": statistics.median(c["ratio"] for c in cases),
            "rounds": len(cases),
        }
        for (size, pattern), cases in by_case.items()
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.netns_kv_bench", description=__doc__[:70])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=9, help="timed pulls per case (kv_bench)")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of (perftest, pulls between hosts, loopback pulls), the order of the two "
        "pull runs alternating (ABBA): on a shared machine, load drifts between runs",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"netns_kv_bench: {reason}")
    logs = Path(tempfile.mkdtemp(prefix="pdserve-netns-kv-bench-"))
    topo = netns.new_topology()
    raw: dict[float, list[float]] = {}
    hosts: list[dict] = []
    loops: list[dict] = []
    t0 = time.perf_counter()
    try:
        netns.build(["b", "c"], topo)
        b, c = topo.hosts["b"], topo.hosts["c"]
        for r in range(args.rounds):
            for mib in args.sizes_mib:
                raw.setdefault(mib, []).append(perftest(b, c, round(mib * MIB), logs))
            for where in ("hosts", "loopback") if r % 2 == 0 else ("loopback", "hosts"):
                if where == "hosts":
                    hosts.append(pdserve_pull(b, c, args.sizes_mib, args.reps, logs, r))
                else:
                    loops.append(loopback_pull(args.sizes_mib, args.reps, logs, r))
    finally:
        problems = topo.teardown()
        if problems or topo.leftovers():
            print("teardown problems:", problems, topo.leftovers(), file=sys.stderr)
    table = markdown(merged(hosts), merged(loops), raw)
    seen = {
        "pdserve": lanes(logs, "kv_bench-*.log"),
        "loopback": lanes(logs, "loopback-*.log"),
        "ucx_perftest": lanes(logs, "perftest.*"),
    }
    print(table)
    for who, found in seen.items():
        print(f"{who} tagged sends: {'; '.join(found) or 'no UCX_PROTO_INFO table'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": "python -m perf.netns_kv_bench " + " ".join(argv or sys.argv[1:]),
            "hosts": {"prefill": "b", "decode": "c", "network": str(topo.network)},
            "host_env": netns.HOST_ENV,
            "seconds": round(time.perf_counter() - t0, 1),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "ucx_perftest_gbps": {f"{k:g}": v for k, v in raw.items()},
            "lanes": seen,
            "between_hosts": merged(hosts),
            "loopback": merged(loops),
            "runs": {"between_hosts": hosts, "loopback": loops},
            "markdown": table,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
