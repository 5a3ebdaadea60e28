"""`make typecheck`'s baseline (.ci/typecheck.py) only shrinks: a new finding fails, a moved one
does not, a fixed one is dropped by --shrink and never comes back without failing. pyright itself
is not run here."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("typecheck", REPO / ".ci" / "typecheck.py")
assert spec and spec.loader
typecheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(typecheck)


def diag(line: int, message: str = 'Object of type "None" is not subscriptable') -> dict:
    return {
        "file": str(REPO / "gateway" / "dispatch.py"),
        "severity": "error",
        "rule": "reportOptionalSubscript",
        "message": message + "\n  a second line of detail",
        "range": {"start": {"line": line, "character": 4}, "end": {"line": line, "character": 9}},
    }


def test_a_finding_that_moves_is_not_new() -> None:
    baseline = typecheck.counts([diag(10)])
    grew, fell = typecheck.compare(baseline, typecheck.counts([diag(42)]))
    assert (grew, fell) == (set(), set())


def test_a_second_finding_of_a_kind_is_new_and_one_fixed_is_reported() -> None:
    baseline = typecheck.counts([diag(10)])
    [kind] = baseline
    message = 'Object of type "None" is not subscriptable'  # the first line alone
    assert kind == ("gateway/dispatch.py", "reportOptionalSubscript", message)
    assert typecheck.compare(baseline, typecheck.counts([diag(10), diag(20)])) == ({kind}, set())
    assert typecheck.compare(baseline, Counter()) == (set(), {kind})


def test_the_baseline_file_round_trips(tmp_path: Path) -> None:
    found = typecheck.counts([diag(1), diag(2), diag(3, "other")])
    typecheck.dump(tmp_path / "b.json", "1.2.3", found)
    assert typecheck.load(tmp_path / "b.json") == ("1.2.3", found)
