"""Anthropic's Python SDK (``anthropic_sdk.py``) against a running pdserve's ``/v1/messages``, in
the SDK's own venv: create, stream, a tool call round trip, count_tokens and errors."""

from __future__ import annotations

import json
from pathlib import Path

from perf.compat.stack import Stack
from perf.compat.tool import ToolResult, installed_version, pdserve_errors, run_logged, venv_bin

TIMEOUT_S = 600.0
SCRIPT = Path(__file__).resolve().parent / "anthropic_sdk.py"


def run_anthropic(stack: Stack, out: Path) -> ToolResult:
    version = installed_version("anthropic", "anthropic")
    log, record_path = out / "anthropic.log", out / "anthropic.json"
    python = str(venv_bin("anthropic", "python"))
    rc, seconds = run_logged(
        [python, str(SCRIPT), stack.base_url, stack.model, str(record_path)], log, TIMEOUT_S
    )
    text = log.read_text(errors="replace") if log.exists() else ""
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    checks = record.get("checks", [])
    passed = sum(c["ok"] for c in checks)
    ok = rc == 0 and bool(checks) and passed == len(checks)
    summary = (
        f"{passed}/{len(checks)} checks: create, stream, tool round trip, count_tokens, errors"
        if checks
        else f"exit {rc}, no record (see {log})"
    )
    return ToolResult("anthropic", version, ok, summary, pdserve_errors(text), record, seconds)
