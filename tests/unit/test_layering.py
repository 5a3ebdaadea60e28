"""The layering DESIGN.md fixes, checked on every import statement (lazy ones inside functions
too): ``pdserve.shared`` and ``pdserve.kernels`` never import upward, and ``pdserve.gateway`` and
``pdserve.services`` never import each other, and only the CLI (``pdserve.cli``, the root's
``cli.py``) sees them all, with plain imports. Project code reaches its own folders only through the ``pdserve``
namespace: a bare ``import kernels`` would be Hugging Face's package, not ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NAMESPACED = {"gateway", "services", "shared", "kernels"}
FORBIDDEN = {
    "shared": {"services", "gateway", "cli", "perf", "tests"},
    "kernels": {"services", "gateway", "cli", "perf", "tests", "shared"},
    "gateway": {"services", "cli", "perf", "tests"},
    "services": {"gateway", "cli", "perf", "tests"},
}


def layer(module: str) -> str:
    """The repository folder an import reaches: `pdserve.services.x` -> services, `perf.x` ->
    perf; a bare name of one of the four namespaced folders is reported as `bare:<name>`."""
    parts = module.split(".")
    if parts[0] == "pdserve" and len(parts) > 1:
        return parts[1]
    return f"bare:{parts[0]}" if parts[0] in NAMESPACED else parts[0]


def imported_packages(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(layer(alias.name), node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((layer(node.module), node.lineno))
    return found


def project_files() -> list[Path]:
    return sorted(
        [REPO / "cli.py"]
        + [p for folder in (*NAMESPACED, "perf", "tests") for p in (REPO / folder).rglob("*.py")]
    )


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_crosses_the_layering(package: str) -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {top}"
        for path in sorted((REPO / package).rglob("*.py"))
        for top, line in imported_packages(path)
        if top in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)


def test_project_code_imports_its_folders_through_the_namespace() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {top.removeprefix('bare:')} without pdserve."
        for path in project_files()
        for top, line in imported_packages(path)
        if top.startswith("bare:")
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from pdserve.services.engine import engine\n    import perf.x\n"
        "    import kernels\n"
    )
    assert imported_packages(module) == {("services", 2), ("perf", 3), ("bare:kernels", 4)}
