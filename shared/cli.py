"""The ``pdserve`` command: one subcommand per process kind, plus tools."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from shared.config import (
    BusConfig,
    EngineConfig,
    GatewayConfig,
    UpConfig,
    WorkerConfig,
    add_options,
)
from shared.errors import StartupError


@dataclass(frozen=True)
class Command:
    help: str
    target: str  # "module:function", imported only when the command runs, to keep start-up fast
    options: tuple[type, ...] = ()
    extra: Callable[[argparse.ArgumentParser], None] | None = None


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jaeger", default="http://127.0.0.1:16686", help="Jaeger query base URL")
    p.add_argument("request_id", nargs="?", help="request id (x-request-id) to show")
    p.add_argument("--last", type=int, default=0, help="show the last N requests instead")
    p.add_argument("--service", default="pdserve-gateway", help="service whose traces are listed")


def _doctor_args(p: argparse.ArgumentParser) -> None:
    from shared.doctor import add_arguments

    add_arguments(p)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from perf.bench_cli import add_arguments

    add_arguments(p)


COMMANDS: dict[str, Command] = {
    "up": Command(
        "run NATS, prefill and decode workers and the gateway locally",
        "services.launcher:run",
        (UpConfig, GatewayConfig, EngineConfig, WorkerConfig, BusConfig),
    ),
    "gateway": Command(
        "run the OpenAI-compatible HTTP gateway",
        "gateway.server:run",
        (GatewayConfig, EngineConfig, BusConfig),
    ),
    "prefill": Command(
        "run a prefill worker",
        "services.prefill.worker:run",
        (WorkerConfig, EngineConfig, BusConfig),
    ),
    "decode": Command(
        "run a decode worker", "services.decode.worker:run", (WorkerConfig, EngineConfig, BusConfig)
    ),
    "bench": Command(
        "benchmark an OpenAI-compatible endpoint", "perf.bench_cli:run", extra=_bench_args
    ),
    "doctor": Command(
        "check the KV transfer path: UCX transports, pull vs raw bandwidth, a running stack",
        "shared.doctor:run",
        extra=_doctor_args,
    ),
    "trace": Command(
        "per-phase breakdown of request traces from Jaeger",
        "shared.trace_cli:run",
        extra=_trace_args,
    ),
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="LLM serving with disaggregated prefill and decode"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        add_options(p, *cmd.options)
        if cmd.extra:
            cmd.extra(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    module_name, func_name = COMMANDS[args.command].target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args) or 0)
    except StartupError as exc:  # a bad --model and the like: one line, not a traceback
        print(f"pdserve {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
