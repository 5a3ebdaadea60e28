"""The layering DESIGN.md fixes, checked on every import statement (lazy ones inside functions
too): ``shared/`` and ``kernels/`` never import upward, and ``gateway/`` and ``services/`` never
import each other. The CLI reaches commands by "module:function" strings, not imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "shared": {"services", "gateway", "perf", "tests"},
    "kernels": {"services", "gateway", "perf", "tests", "shared"},
    "gateway": {"services", "perf", "tests"},
    "services": {"gateway", "perf", "tests"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_crosses_the_layering(package: str) -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {top}"
        for path in sorted((REPO / package).rglob("*.py"))
        for top, line in imported_packages(path)
        if top in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from services.engine import engine\n    import perf.x\n")
    assert imported_packages(module) == {("services", 2), ("perf", 3)}
