"""The layering DESIGN.md fixes, checked on every import statement (lazy ones inside functions
too): ``pdserve.shared`` and ``pdserve.kernels`` never import upward, and ``pdserve.gateway`` and
``pdserve.services`` never import each other, and only the CLI (``pdserve.cli``, the root's
``cli.py``) sees them all, with plain imports. Project code reaches its own folders only through the ``pdserve``
namespace: a bare ``import kernels`` would be Hugging Face's package, not ours. Within the
layers, no modules import each other in a circle, and no file of product code passes 400 lines."""

from __future__ import annotations

import ast
import os
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


# ---- no import circles ----------------------------------------------------------------------
# A circle makes import order matter (one side must hide its import in a function) and ties
# modules that should be read and tested apart. Every import counts: lazy ones and those under
# TYPE_CHECKING too, since hiding an import is how a circle is usually papered over. A package's
# implicit import of its own __init__ is not an edge (ours hold docstrings only).


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """pdserve's own modules by dotted name: the four folders and the root's cli.py."""
    modules = {"pdserve.cli": root / "cli.py"}
    for folder in sorted(NAMESPACED):
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join(("pdserve", *parts))] = path
    return modules


def imported_project_modules(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The project modules ``name`` imports, each with the line of its first import there.
    ``from pkg import x`` is the module ``pkg.x`` when there is one, else ``pkg`` itself."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, int] = {}

    def add(module: str, line: int) -> None:
        if module in modules and module != name:
            found.setdefault(module, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, up level - 1
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else base, node.lineno)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {name: imported_project_modules(name, path, modules) for name, path in modules.items()}


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative
    so that a long import chain cannot reach the recursion limit), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def describe_circles(circles: list[list[str]], graph: dict[str, dict[str, int]]) -> str:
    """Each circle, then every import inside it with its line: where the circle can be cut."""
    modules = project_modules()
    out = []
    for circle in circles:
        out.append("circle: " + " <-> ".join(circle))
        for name in circle:
            where = modules[name].relative_to(REPO) if name in modules else name
            out += [
                f"    {where}:{line} imports {target}"
                for target, line in sorted(graph[name].items())
                if target in circle
            ]
    return "\n".join(out)


def test_no_import_circles() -> None:
    graph = import_graph(project_modules())
    circles = import_circles(graph)
    assert not circles, f"{len(circles)} import circle(s):\n" + describe_circles(circles, graph)


def test_the_circle_check_counts_hidden_imports(tmp_path: Path) -> None:
    """A lazy ``from package import module`` one way and a TYPE_CHECKING import back make a
    circle; a relative import is resolved; a chain without a way back is none."""
    (tmp_path / "gateway" / "pkg").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "cli.py").write_text("import pdserve.gateway.a\n")
    (tmp_path / "gateway" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdserve.gateway.pkg.b import B\n"
    )
    (tmp_path / "gateway" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "gateway" / "pkg" / "b.py").write_text(
        "def f():\n    from pdserve.gateway import a\n    from . import c\n"
    )
    (tmp_path / "gateway" / "pkg" / "c.py").write_text("from pdserve.shared import d\n")
    (tmp_path / "shared" / "d.py").write_text("import os\n")
    graph = import_graph(project_modules(tmp_path))
    assert graph["pdserve.gateway.pkg.b"] == {"pdserve.gateway.a": 2, "pdserve.gateway.pkg.c": 3}
    assert graph["pdserve.gateway.pkg.c"] == {"pdserve.shared.d": 1}
    assert import_circles(graph) == [["pdserve.gateway.a", "pdserve.gateway.pkg.b"]]
    graph["pdserve.shared.d"]["pdserve.cli"] = 1  # d -> cli -> a -> b -> c -> d
    assert import_circles(graph) == [
        [
            "pdserve.cli",
            "pdserve.gateway.a",
            "pdserve.gateway.pkg.b",
            "pdserve.gateway.pkg.c",
            "pdserve.shared.d",
        ]
    ]


# ---- commands apart from the runtime -----------------------------------------------------------
# services/control/ holds the commands (up, autoscale, rollout, plan, bench, doctor, trace); the
# rest of services/ is the workers' runtime, which runs without them. parallel/ is the engine's
# tensor-parallel plumbing, imported by the model and the engine: it may use their plain data
# types (the model's config, a step's inputs) but nothing that builds or runs a model - the
# process of a rank other than 0, which does, is services/engine/rank_process.py.

CONTROL = "pdserve.services.control"
PARALLEL = "pdserve.services.engine.parallel"
PARALLEL_MAY_USE = {"pdserve.services.engine.model_config", "pdserve.services.engine.outputs"}


def test_the_runtime_never_imports_the_commands() -> None:
    modules = project_modules()
    graph = import_graph(modules)
    bad = [
        f"{modules[name].relative_to(REPO)}:{line} imports {target}"
        for name, targets in sorted(graph.items())
        if not name.startswith(CONTROL) and name != "pdserve.cli"
        for target, line in sorted(targets.items())
        if target == CONTROL or target.startswith(CONTROL + ".")
    ]
    assert not bad, "\n".join(bad)


def test_shared_holds_no_commands() -> None:
    """A command's modules are imported by the CLI alone; shared/ is what several processes use."""
    assert not [p for p in (REPO / "shared").rglob("*.py") if p.stem in {"cli", "command"}]


def test_parallel_imports_nothing_above_it() -> None:
    modules = project_modules()
    graph = import_graph(modules)
    bad = [
        f"{modules[name].relative_to(REPO)}:{line} imports {target}"
        for name, targets in sorted(graph.items())
        if name.startswith(PARALLEL)
        for target, line in sorted(targets.items())
        if target.startswith("pdserve.services.")
        and not target.startswith(PARALLEL)
        and target not in PARALLEL_MAY_USE
    ]
    assert not bad, "\n".join(bad)


# ---- file size -------------------------------------------------------------------------------

MAX_LINES = 400  # a module one can read in a sitting; past it, split by concern


def test_no_project_file_exceeds_400_lines() -> None:
    too_long = [
        f"{path.relative_to(REPO)}: {lines} lines"
        for path in sorted(project_modules().values())
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    ]
    assert not too_long, f"over {MAX_LINES} lines:\n" + "\n".join(too_long)


# ---- formatting ------------------------------------------------------------------------------

# Spelled in two pieces so that this file does not match its own check.
FORMATTER_OFF = ("# fmt: " + "skip", "# fmt: " + "off")


def python_sources(root: Path = REPO) -> list[Path]:
    """Every .py file of the repository: hidden folders (.venv, .git) and build outputs aside."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in {"build", "__pycache__"}]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def test_the_formatter_is_never_switched_off() -> None:
    """Packed lines hidden from ruff format read worse than the formatter's; keep none."""
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in python_sources()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(marker in line for marker in FORMATTER_OFF)
    ]
    assert not offenders, "formatter switched off at:\n" + "\n".join(offenders)
