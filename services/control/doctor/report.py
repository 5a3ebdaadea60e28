"""The doctor's findings and the one-screen summary they end in.

Each check is one line a person can scan - a status tag, a short name, what was found - with a
few indented detail lines where a table says more (protocol lanes, the bandwidth sizes, each
worker pair). The same report can be written as JSON for a bug tracker or a CI job.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
_TAGS = {OK: "[ OK ]", INFO: "[INFO]", WARN: "[WARN]", FAIL: "[FAIL]"}
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class DoctorInputError(Exception):
    """What the doctor was asked to check cannot be reached or makes no sense (exit 2)."""


@dataclass
class Check:
    name: str
    status: str  # OK, INFO, WARN or FAIL
    summary: str
    details: list[str] = field(default_factory=list)


@dataclass
class Report:
    header: list[str] = field(default_factory=list)  # what was checked, with which software
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # raw measurements, for --json

    def add(self, name: str, status: str, summary: str, details: list[str] | None = None) -> Check:
        check = Check(name=name, status=status, summary=summary, details=list(details or []))
        self.checks.append(check)
        return check

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.checks)

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.count(FAIL) else EXIT_OK

    def render(self) -> str:
        failed, warned = self.count(FAIL), self.count(WARN)
        width = max((len(c.name) for c in self.checks), default=8)
        lines = ["pdserve doctor: is the KV transfer path what it should be?", *self.header, ""]
        for c in self.checks:
            lines.append(f"{_TAGS[c.status]} {c.name:<{width}}  {c.summary}")
            lines += [f"{'':{width + 9}}{d}" for d in c.details]
        verdict = "FAILED" if failed else "passed"
        lines += [
            "",
            f"{verdict}: {failed} failed, {warned} warning(s), "
            f"{self.count(OK) + self.count(INFO)} ok -> exit {self.exit_code}",
        ]
        return "\n".join(lines)

    def write_json(self, path: Path) -> None:
        body = {
            "exit_code": self.exit_code,
            "header": self.header,
            "checks": [asdict(c) for c in self.checks],
            **self.data,
        }
        path.write_text(json.dumps(body, indent=2) + "\n")


def host_line() -> str:
    import os

    return (
        f"host {platform.node()}: {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )
