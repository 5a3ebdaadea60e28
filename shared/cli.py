"""The ``pdserve`` command: one subcommand per process kind, plus tools."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.shared.config import (
    BusConfig,
    EngineConfig,
    GatewayConfig,
    UpConfig,
    WorkerConfig,
    add_options,
)
from pdserve.shared.errors import StartupError


@dataclass(frozen=True)
class Command:
    help: str
    # "module:function" strings, imported only when needed: start-up stays fast, and this module
    # (in shared/) never imports the layers above it (gateway/, services/).
    target: str
    options: tuple[type, ...] = ()
    extra: str | None = None  # adds the command's own arguments to its parser


def _load(spec: str) -> Callable:
    module_name, func_name = spec.split(":")
    return getattr(importlib.import_module(module_name), func_name)


COMMANDS: dict[str, Command] = {
    "up": Command(
        "run NATS, prefill and decode workers and the gateway locally",
        "pdserve.services.launcher:run",
        (UpConfig, GatewayConfig, EngineConfig, WorkerConfig, BusConfig),
    ),
    "gateway": Command(
        "run the OpenAI-compatible HTTP gateway",
        "pdserve.gateway.server:run",
        (GatewayConfig, EngineConfig, BusConfig),
    ),
    "prefill": Command(
        "run a prefill worker",
        "pdserve.services.prefill.worker:run",
        (WorkerConfig, EngineConfig, BusConfig),
    ),
    "decode": Command(
        "run a decode worker",
        "pdserve.services.decode.worker:run",
        (WorkerConfig, EngineConfig, BusConfig),
    ),
    "bench": Command(
        "benchmark an OpenAI-compatible endpoint",
        "pdserve.shared.bench.cli:run",
        extra="pdserve.shared.bench.cli:add_arguments",
    ),
    "doctor": Command(
        "check the KV transfer path: UCX transports, pull vs raw bandwidth, a running stack",
        "pdserve.shared.doctor:run",
        extra="pdserve.shared.doctor:add_arguments",
    ),
    "trace": Command(
        "per-phase breakdown of request traces from Jaeger",
        "pdserve.shared.trace_cli:run",
        extra="pdserve.shared.trace_cli:add_arguments",
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
            _load(cmd.extra)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    func = _load(COMMANDS[args.command].target)
    try:
        return int(func(args) or 0)
    except StartupError as exc:  # a bad --model and the like: one line, not a traceback
        print(f"pdserve {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
