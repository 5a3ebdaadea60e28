"""The README's request walk-through and the reference docs name code as ``path.py:Name.attr``.
Every such reference must still point at a file that exists and a name defined in it, so a
rename or a split that forgets the docs fails here instead of sending a newcomer nowhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"((?:gateway|services|shared|kernels|perf|tests)/[\w/]+\.py)(?::([\w.]+))?")


def documents() -> list[Path]:
    return sorted(
        [REPO / "README.md", *(REPO / "docs").glob("*.md"), *REPO.glob("*/README.md")]
        + [REPO / "gateway" / "inflight" / "__init__.py", REPO / "shared" / "kv" / "contract.py"]
    )


def defined_names(path: Path) -> set[str]:
    """Classes, functions and methods (at any depth) and module-level assignments."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def broken_references(document: Path) -> list[str]:
    broken = []
    for match in REFERENCE.finditer(document.read_text(encoding="utf-8")):
        path, symbol = REPO / match.group(1), match.group(2)
        if not path.exists():
            broken.append(f"{match.group(0)}: no such file")
        elif symbol:
            names = defined_names(path)
            missing = [part for part in symbol.split(".") if part and part not in names]
            if missing:
                broken.append(f"{match.group(0)}: {missing[0]} is not defined there")
    return broken


def test_every_code_reference_in_the_docs_resolves() -> None:
    broken = [
        f"{doc.relative_to(REPO)}: {ref}" for doc in documents() for ref in broken_references(doc)
    ]
    assert not broken, "\n".join(broken)


def test_a_stale_reference_is_caught(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`gateway/server.py:create_app` and `gateway/server.py:no_such_handler`, "
        "`gateway/no_such_module.py`"
    )
    assert broken_references(doc) == [
        "gateway/server.py:no_such_handler: no_such_handler is not defined there",
        "gateway/no_such_module.py: no such file",
    ]
