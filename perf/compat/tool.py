"""What every client run shares: where its venv is, running it with a log, its result, and the
error text pdserve answered with when a request failed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

COMPAT_DIR = Path(os.environ.get("PDSERVE_COMPAT_DIR", Path.home() / ".cache/pdserve-compat"))
INSTALL = Path(__file__).resolve().parent / "install.sh"
# Each tool talks only to the local stack: no hub look-ups, no telemetry.
HF_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUIET_ENV = {
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "NO_COLOR": "1",
}


@dataclass
class ToolResult:
    tool: str
    version: str
    ok: bool  # every request succeeded and (lm-eval) pdserve agreed with HF transformers
    summary: str  # one line for the console
    errors: list[str] = field(default_factory=list)  # distinct error texts, pdserve's first
    details: dict = field(default_factory=dict)
    seconds: float = 0.0


def venv_bin(tool: str, program: str) -> Path:
    return COMPAT_DIR / tool / "bin" / program


def install(tool: str) -> None:
    subprocess.run(["bash", str(INSTALL), tool], check=True)


def installed_version(tool: str, distribution: str) -> str:
    python = venv_bin(tool, "python")
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "not installed"


def run_logged(
    argv: list[str], log: Path, timeout_s: float, cwd: Path | None = None, hf_offline: bool = True
) -> tuple[int, float]:
    """(exit code, seconds) of ``argv`` with stdout and stderr in ``log``; 124 on timeout."""
    env = {**os.environ, **QUIET_ENV, **(HF_OFFLINE_ENV if hf_offline else {})}
    env.pop("PYTHONPATH", None)  # the tool's own venv, never pdserve's modules
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        try:
            rc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


_ERROR_BODY = re.compile(r'\{\s*"error"\s*:\s*\{.*?"message"\s*:\s*"((?:[^"\\]|\\.)*)"')


def pdserve_errors(text: str, limit: int = 5) -> list[str]:
    """The distinct ``error.message`` texts of pdserve's JSON error bodies found in ``text``."""
    found: list[str] = []
    for match in _ERROR_BODY.finditer(text):
        try:
            message = json.loads(f'"{match.group(1)}"')
        except ValueError:
            message = match.group(1)
        if message not in found:
            found.append(message)
        if len(found) >= limit:
            break
    return found


def tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
