"""``pdserve doctor``: check the KV transfer path before trusting it.

UCX never fails over to a slow path loudly - a build without RDMA, or a UCX_TLS that leaves it
out, just moves the KV over TCP at a hundredth of the speed. The doctor looks before anyone
benchmarks:

1. locally, in two child processes over ``--ucx-host`` (``services/control/doctor/ucx.py``): UCX's
   version and build, the transports and devices UCX selected for their endpoint, RDMA or CUDA
   hardware that UCX left unused, and pdserve's KV pull against a raw UCX send of the same bytes
   at each ``--sizes-mib``;
2. this host's roofs (``services/control/doctor/peaks.py``): peak GEMM FLOP/s at the model's dtype and
   memory-read bandwidth, at the thread count a worker runs at, cached for the workers'
   roofline telemetry;
3. with ``--nats-url``, against a running stack (``services/control/doctor/stack.py``): every decode
   worker pulls a one-block probe lease from every prefill worker, and workers of tensor
   parallel size > 1 list their ranks: each one's pid and the UCX transports of its KV endpoint.

Exit status: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 when the input
is unusable (NATS unreachable, ``--ucx-host`` not on this machine, nonsense sizes) - that last
one prints one line, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.services.control.doctor.report import (
    EXIT_BAD_INPUT,
    FAIL,
    INFO,
    OK,
    DoctorInputError,
    Report,
    host_line,
)
from pdserve.shared.config import BusConfig
from pdserve.shared.options import add_options, build, opt

DEFAULT_SIZES_MIB = (1.0, 8.0, 64.0)
MAX_SIZE_MIB = 4096.0


@dataclass
class DoctorConfig:
    nats_url: str | None = opt(
        None, "also check the running stack behind this NATS server (omit: local checks only)"
    )
    ucx_host: str = opt(
        "127.0.0.1", "address the peer test's two processes use for UCX, like a worker's"
    )
    reps: int = opt(5, "timed pull/raw repetitions per size in the peer test")
    min_ratio: float = opt(
        0.5, "fail when pdserve's pull reaches less than this fraction of raw UCX throughput"
    )
    min_gbps: float = opt(0.0, "fail when a pull is slower than this many GB/s (0: no floor)")
    peer_test: bool = opt(True, "run the local two-process test (--no-peer-test skips it)")
    peaks: bool = opt(
        True,
        "measure this host's peak GEMM FLOP/s and memory-read bandwidth and cache them for the "
        "workers' roofline telemetry (--no-peaks skips it)",
    )
    device: str = opt("auto", "device whose peaks are measured, as a worker's --device")
    dtype: str = opt(
        "auto",
        "GEMM dtype of the peaks, as a worker's --dtype (auto: bfloat16 on a GPU, else float32)",
        choices=("auto", "float32", "bfloat16", "float16", "float64"),
    )
    torch_threads: int = opt(
        0,
        "CPU peaks at this many torch threads, as a worker's --torch-threads (0: each CPU share "
        "pdserve up gives its default workers)",
    )
    timeout: float = opt(5.0, "seconds to wait for NATS and for each worker's answer")
    discover_seconds: float = opt(2.0, "how long to listen for worker heartbeats")
    peer_timeout: float = opt(180.0, "seconds the whole peer test may take")
    json: str | None = opt(None, "also write the report as JSON to this file")


def _sizes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in MiB: {text!r}") from None
    if not 0 < value <= MAX_SIZE_MIB:
        raise argparse.ArgumentTypeError(f"sizes must be in (0, {MAX_SIZE_MIB:g}] MiB")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get("PDSERVE_SIZES_MIB")
    default = [_sizes(s) for s in env.split(",") if s.strip()] if env else DEFAULT_SIZES_MIB
    p.add_argument(
        "--sizes-mib",
        type=_sizes,
        nargs="+",
        default=list(default),
        help="transfer sizes of the peer test [env PDSERVE_SIZES_MIB, comma separated]",
    )
    add_options(p, DoctorConfig, BusConfig)  # BusConfig's own nats_url gives way to ours


def _validate(cfg: DoctorConfig) -> None:
    from pdserve.shared.kv.ucx_config import UCXConfigError, interface_for

    try:
        interface_for(cfg.ucx_host)
    except UCXConfigError as exc:
        raise DoctorInputError(str(exc)) from None
    if cfg.torch_threads < 0:
        raise DoctorInputError("--torch-threads must be 0 or more")
    if cfg.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", cfg.device):
        raise DoctorInputError(f"--device {cfg.device!r}: auto, cpu or cuda[:N]")
    for name in ("reps", "timeout", "discover_seconds", "peer_timeout"):
        if getattr(cfg, name) <= 0:
            raise DoctorInputError(f"--{name.replace('_', '-')} must be positive")


async def diagnose(cfg: DoctorConfig, bus: BusConfig, sizes: list[float]) -> Report:
    from pdserve.services.control.doctor import ucx as doctor_ucx
    from pdserve.shared.kv.ucx_config import interface_for

    report = Report(header=[host_line()])
    stack = None
    if cfg.nats_url:
        from pdserve.services.control.doctor.stack import StackCheck

        bus.nats_url = cfg.nats_url
        stack = StackCheck(bus, cfg.timeout)
        await stack.connect()  # before the slow part: unreachable NATS is bad input (exit 2)
    try:
        device = interface_for(cfg.ucx_host) or "every interface"
        report.add("ucx-host", OK, f"{cfg.ucx_host} -> {device}")
        if cfg.peer_test:
            _progress(f"peer test over {cfg.ucx_host}: {', '.join(f'{s:g}' for s in sizes)} MiB")
            run = await doctor_ucx.run_peer_test(cfg.ucx_host, sizes, cfg.reps, 1, cfg.peer_timeout)
            report.header += doctor_ucx.header_lines(run.outcome.get("ucx", {}))
            report.data["peer_test"] = run.outcome
            doctor_ucx.add_transport_checks(report, run)
            doctor_ucx.add_peer_check(
                report, run, cfg.ucx_host, cfg.min_ratio, cfg.min_gbps, cfg.reps
            )
        else:
            report.add("peer test", INFO, "skipped (--no-peer-test)")
        if cfg.peaks:
            await _measure_peaks(report, cfg)
        else:
            report.add("peaks", INFO, "skipped (--no-peaks)")
        if stack is not None:
            _progress(f"probing the stack behind {cfg.nats_url}")
            await stack.run(report, cfg.discover_seconds)
    finally:
        if stack is not None:
            await stack.close()
    return report


async def _measure_peaks(report: Report, cfg: DoctorConfig) -> None:
    from pdserve.services.control.doctor import peaks as doctor_peaks

    found_targets = doctor_peaks.targets(cfg.device, cfg.dtype, cfg.torch_threads)
    if not found_targets:
        report.add("peaks", FAIL, f"--device {cfg.device}: no such device visible to torch")
    for target in found_targets:
        threads = f", {target.threads} thread(s)" if target.device == "cpu" else ""
        _progress(f"measuring the peaks of {target.device} {target.dtype}{threads}")
        try:  # off the event loop: a stack's NATS connection stays served meanwhile
            found = await asyncio.to_thread(doctor_peaks.measure_and_cache, target, False)
        except Exception as exc:  # a check that failed, never a traceback: CUDA missing or OOM
            found = exc
        doctor_peaks.add_peaks_check(report, target, found)


def _progress(text: str) -> None:
    print(f"pdserve doctor: {text} ...", file=sys.stderr, flush=True)


def run(ns: argparse.Namespace) -> int:
    # Only the report speaks: library warnings (a NATS reconnect, asyncio) would bury it.
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "CRITICAL"))
    cfg, bus = build(DoctorConfig, ns), build(BusConfig, ns)
    try:
        _validate(cfg)
        report = asyncio.run(diagnose(cfg, bus, list(ns.sizes_mib)))
    except DoctorInputError as exc:
        print(f"pdserve doctor: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    print(report.render(), flush=True)
    if cfg.json:
        report.write_json(Path(cfg.json))
    return report.exit_code
