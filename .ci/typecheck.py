"""`make typecheck`: pyright on the product code, against a baseline that may only shrink.

pyright runs at the strictness [tool.pyright] in pyproject.toml sets (basic) on cli.py and the
four folders. Its findings of the day it was added are recorded in pyright-baseline.json beside
this file, counted by (file, rule, first line of the message): line numbers are left out, so
edits that move a finding do not count as new. The check fails when any count grows, naming the
findings of that kind; a count that fell is reported, and `--shrink` lowers the baseline to match
(it never raises a count). `--reset` records every finding anew: only for a deliberate change,
such as a new pyright whose messages differ, or files moved (the key holds the path); it prints
the old total beside the new, which should not have grown.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = Path(__file__).resolve().parent / "pyright-baseline.json"
PATHS = ("cli.py", "gateway", "services", "shared", "kernels")

Key = tuple[str, str, str]  # (file, rule, first line of the message)


def run_pyright() -> tuple[str, list[dict]]:
    """pyright's version and its diagnostics, from the venv this script runs in."""
    pyright = Path(sys.executable).parent / "pyright"
    proc = subprocess.run(
        [str(pyright), "--outputjson", *PATHS], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode not in (0, 1):  # 0: no errors, 1: errors; anything else: it failed
        sys.exit(f"pyright failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout)
    return report["version"], report["generalDiagnostics"]


def key(diag: dict) -> Key:
    file = Path(diag["file"]).resolve().relative_to(REPO).as_posix()
    return file, diag.get("rule", diag["severity"]), diag["message"].splitlines()[0]


def counts(diags: list[dict]) -> Counter[Key]:
    return Counter(key(d) for d in diags)


def load(path: Path) -> tuple[str, Counter[Key]]:
    data = json.loads(path.read_text())
    found: Counter[Key] = Counter()
    for file, entries in data["findings"].items():
        for entry in entries:
            found[file, entry["rule"], entry["message"]] = entry["count"]
    return data["pyright"], found


def dump(path: Path, version: str, found: Counter[Key]) -> None:
    findings: dict[str, list[dict]] = {}
    for (file, rule, message), n in sorted(found.items()):
        if n > 0:
            findings.setdefault(file, []).append({"rule": rule, "message": message, "count": n})
    path.write_text(json.dumps({"pyright": version, "findings": findings}, indent=1) + "\n")


def compare(baseline: Counter[Key], now: Counter[Key]) -> tuple[set[Key], set[Key]]:
    """(kinds of finding that grew, kinds that fell)."""
    grew = {k for k, n in now.items() if n > baseline[k]}
    fell = {k for k, n in baseline.items() if now[k] < n}
    return grew, fell


def where(diag: dict) -> str:
    start = diag["range"]["start"]
    file = Path(diag["file"]).resolve().relative_to(REPO).as_posix()
    rule = diag.get("rule", "")
    message = diag["message"].replace("\n", "\n    ")
    return f"{file}:{start['line'] + 1}:{start['character'] + 1} - {message} ({rule})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--shrink", action="store_true", help="drop fixed findings from the baseline")
    mode.add_argument("--reset", action="store_true", help="record every finding anew")
    ns = p.parse_args(argv)

    version, diags = run_pyright()
    now = counts(diags)
    if ns.reset:
        was = sum(load(BASELINE)[1].values()) if BASELINE.exists() else 0
        dump(BASELINE, version, now)
        print(f"typecheck: {sum(now.values())} findings recorded in {BASELINE.name} (were {was})")
        return 0
    recorded, baseline = load(BASELINE)
    if recorded != version:
        print(
            f"typecheck: the baseline is of pyright {recorded}, this is {version}: messages may differ"
        )
    grew, fell = compare(baseline, now)
    if ns.shrink:
        shrunk = Counter({k: min(n, now[k]) for k, n in baseline.items()})
        dump(BASELINE, recorded, shrunk)
        print(f"typecheck: {sum(baseline[k] - now[k] for k in fell)} fixed findings dropped")
        baseline = shrunk
    elif fell:
        gone = sum(baseline[k] - now[k] for k in fell)
        print(
            f"typecheck: {gone} baseline findings are fixed: `.venv/bin/python .ci/typecheck.py "
            "--shrink` drops them from the baseline"
        )
    if grew:
        print(
            f"typecheck: new pyright findings (beyond the {sum(baseline.values())} of the baseline):"
        )
        for d in diags:
            if key(d) in grew:
                print("  " + where(d))
        print("(each kind is listed in full, the baseline's occurrences included: fix the new one)")
        return 1
    print(f"typecheck: {sum(now.values())} findings, none new (baseline: {sum(baseline.values())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
