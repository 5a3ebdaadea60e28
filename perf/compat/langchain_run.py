"""LangChain's tool-calling agent loop (``langchain_agent.py``) against a running pdserve, in
LangChain's own venv: one loop, a local Python tool, until a text answer."""

from __future__ import annotations

import json
from pathlib import Path

from perf.compat.stack import Stack
from perf.compat.tool import ToolResult, installed_version, pdserve_errors, run_logged, venv_bin

TIMEOUT_S = 600.0
AGENT = Path(__file__).resolve().parent / "langchain_agent.py"


def run_langchain(stack: Stack, out: Path) -> ToolResult:
    version = installed_version("langchain", "langchain-openai")
    log, record_path = out / "langchain.log", out / "langchain.json"
    argv = [
        str(venv_bin("langchain", "python")),
        str(AGENT),
        f"{stack.base_url}/v1",
        stack.model,
        str(record_path),
    ]
    rc, seconds = run_logged(argv, log, TIMEOUT_S)
    text = log.read_text(errors="replace") if log.exists() else ""
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    calls = record.get("calls", [])
    ok = rc == 0 and bool(calls)
    summary = (
        f"agent loop: {len(calls)} tool call(s) {[c['args'] for c in calls]} over "
        f"{record.get('turns', 0)} turn(s), answer {str(record.get('answer'))[:60]!r}"
        if record
        else f"exit {rc}, no record (see {log})"
    )
    return ToolResult("langchain", version, ok, summary, pdserve_errors(text), record, seconds)
