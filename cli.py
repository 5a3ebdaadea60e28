"""The ``pdserve`` command: one subcommand per process kind, plus tools.

This is the one module above both the gateway and the services (tests/unit/test_layering.py).
A command's layer is imported only when that command runs, in its own small function: the
gateway process never loads torch, and ``pdserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.services.control import rollout_command, trace_cli
from pdserve.services.control.bench import cli as bench_cli
from pdserve.services.control.doctor import command as doctor_command
from pdserve.services.control.planner import command as plan_command
from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig, UpConfig, WorkerConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.options import add_options


def _up(ns: argparse.Namespace) -> int:
    from pdserve.services.control.launcher import run

    return run(ns)


def _gateway(ns: argparse.Namespace) -> int:
    from pdserve.gateway.server import run

    return run(ns)


def _prefill(ns: argparse.Namespace) -> int:
    from pdserve.services.prefill.worker import run

    return run(ns)


def _decode(ns: argparse.Namespace) -> int:
    from pdserve.services.decode.worker import run

    return run(ns)


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[argparse.Namespace], int | None]
    options: tuple[type, ...] = ()
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


COMMANDS: dict[str, Command] = {
    "up": Command(
        help="run NATS, prefill and decode workers and the gateway locally",
        run=_up,
        options=(UpConfig, GatewayConfig, EngineConfig, WorkerConfig, BusConfig),
    ),
    "gateway": Command(
        help="run the OpenAI-compatible HTTP gateway",
        run=_gateway,
        options=(GatewayConfig, EngineConfig, BusConfig),
    ),
    "prefill": Command(
        help="run a prefill worker", run=_prefill, options=(WorkerConfig, EngineConfig, BusConfig)
    ),
    "decode": Command(
        help="run a decode worker", run=_decode, options=(WorkerConfig, EngineConfig, BusConfig)
    ),
    "bench": Command(
        help="benchmark an OpenAI-compatible endpoint",
        run=bench_cli.run,
        add_arguments=bench_cli.add_arguments,
    ),
    "doctor": Command(
        help="check the KV transfer path: UCX transports, pull vs raw bandwidth, a running stack",
        run=doctor_command.run,
        add_arguments=doctor_command.add_arguments,
    ),
    "plan": Command(
        help="profile this model here and size prefill and decode workers for a workload and SLOs",
        run=plan_command.run,
        add_arguments=plan_command.add_arguments,
    ),
    "rollout": Command(
        help="swap the model of a running pdserve up: load, verify, switch, drain (or roll back)",
        run=rollout_command.run,
        options=(BusConfig,),
        add_arguments=rollout_command.add_arguments,
    ),
    "trace": Command(
        help="per-phase breakdown of request traces from Jaeger",
        run=trace_cli.run,
        add_arguments=trace_cli.add_arguments,
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
        if cmd.add_arguments:
            cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return int(COMMANDS[args.command].run(args) or 0)
    except StartupError as exc:  # a bad --model and the like: one line, not a traceback
        print(f"pdserve {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
