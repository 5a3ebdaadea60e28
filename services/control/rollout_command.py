"""``pdserve rollout --model NEW``: ask a running ``pdserve up`` (over NATS, services/control/channel.py)
to swap its model version with no downtime (services/control/rollout.py), and wait for the outcome.

Exit 0 when the new version serves and the old workers have drained; 1 when it was refused or
rolled back (the old version keeps serving; the reason is printed); 2 when no launcher answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pdserve.shared.config import BusConfig
from pdserve.shared.options import build


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="the new version: a checkpoint directory, "
        ".gguf file or built-in name, as pdserve up --model takes",
    )
    parser.add_argument(
        "--model-version",
        default="",
        help="the version name /v1/models shows (default: from --model's path)",
    )
    parser.add_argument(
        "--served-model-name",
        default="",
        help="must be the gateway's current name (a rename needs a restart)",
    )
    parser.add_argument(
        "--expect-tokens",
        default="",
        help="comma-separated token ids the probe's greedy answer must start with",
    )
    parser.add_argument(
        "--rollout-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the outcome (loading, probe, drain)",
    )


def run(ns: argparse.Namespace) -> int:
    from pdserve.services.control.channel import request

    body = {
        "op": "rollout",
        "model": ns.model,
        "model_version": ns.model_version,
        "served_model_name": ns.served_model_name,
        "expect": [int(t) for t in ns.expect_tokens.split(",") if t.strip()],
    }
    try:
        answer = asyncio.run(request(build(BusConfig, ns), body, ns.rollout_timeout))
    except Exception as exc:  # noqa: BLE001 - no launcher, no NATS: one line
        print(f"pdserve rollout: no answer from pdserve up ({exc!r})", file=sys.stderr)
        return 2
    print(json.dumps(answer, indent=2))
    if not answer.get("ok"):
        print(f"pdserve rollout: {answer.get('error')}", file=sys.stderr)
        return 1
    return 0
