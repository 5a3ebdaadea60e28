"""The fast tier stays model-free, checked on the source as test_layering.py checks imports:
no module of tests/unit (nor a ``tests`` helper it imports, followed transitively) imports a
checkpoint builder, the HF oracle or transformers, or a module of a slower tier; no test or
fixture asks for the model fixtures of tests/conftest.py; and no process is started but a fresh
Python interpreter on a snippet that obeys these same rules.

That one exception is for facts only a new interpreter shows (hashes stable across hash seeds,
a module that stays light to import, spans flushed at exit); it costs well under a second. The
CLI, servers and nats-server belong to tests/integration and above: `make test-fast` must stay
under a minute on 2 cores."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "tests" / "unit"

# Build a checkpoint, load weights, or run transformers (the oracle): tests/engine's tools.
MODEL_MODULES = {
    "tests.checkpoints",
    "tests.engine_support",
    "tests.oracle",
    "tests.hf_reference",
    "transformers",
}
# Importing a slower tier's module would drag its helpers (and their costs) in.
SLOWER_TIERS = {
    "tests.engine",
    "tests.kernels",
    "tests.integration",
    "tests.multihost",
    "tests.docker",
}
# tests/conftest.py's session fixtures that build checkpoints or load transformers.
MODEL_FIXTURES = {"checkpoints", "llama_dir", "hf", "hf_tok"}
# A snippet run in a fresh interpreter must not start the CLI either.
CLI = frozenset({"pdserve.cli"})
# subprocess's ways to start a program, each given its argv first.
SPAWNERS = {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}
# Anything else that starts a process or a shell.
OTHER_PROCESSES = {
    ("os", "system"),
    ("os", "popen"),
    ("os", "fork"),
    ("os", "forkpty"),
    ("os", "posix_spawn"),
    ("os", "posix_spawnp"),
    ("asyncio", "create_subprocess_shell"),
}


def imported_modules(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every module an import names, lazy ones too; ``from pkg import name`` yields
    ``pkg.name`` as well, in case the name is a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def within(module: str, packages: AbstractSet[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Names bound to one string literal anywhere in the module (module level or in a function):
    enough to read the snippet a test hands to a fresh interpreter."""
    seen: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        seen.setdefault(target.id, set()).add(node.value.value)
    return {name: values.pop() for name, values in seen.items() if len(values) == 1}


def snippet_of(argv: list[ast.expr], constants: dict[str, str]) -> str | None:
    """The code of ``[sys.executable, "-c", CODE, ...]`` when CODE can be read statically."""
    if len(argv) < 3 or ast.unparse(argv[0]) != "sys.executable":
        return None
    if not (isinstance(argv[1], ast.Constant) and argv[1].value == "-c"):
        return None
    code = argv[2]
    if isinstance(code, ast.Constant) and isinstance(code.value, str):
        return code.value
    return constants.get(code.id) if isinstance(code, ast.Name) else None


def renders_manifests(argv: list[ast.expr]) -> bool:
    """``[KUBECTL, "kustomize", DIR]``: kubectl prints the rendered YAML of a folder and starts
    nothing else, in a fraction of a second (tests/unit/test_kubernetes_manifests.py)."""
    return (
        len(argv) >= 2
        and ast.unparse(argv[0]) == "KUBECTL"
        and isinstance(argv[1], ast.Constant)
        and argv[1].value == "kustomize"
    )


def process_problems(tree: ast.Module, where: str) -> list[str]:
    constants = string_constants(tree)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("subprocess", "multiprocessing"):
            problems.append(f"{where}:{node.lineno} imports from {node.module}")
        for alias in node.names if isinstance(node, ast.Import) else ():
            if within(alias.name, {"multiprocessing"}):
                problems.append(f"{where}:{node.lineno} imports multiprocessing")
            elif alias.name == "subprocess" and alias.asname:  # the calls below go unseen
                problems.append(f"{where}:{node.lineno} imports subprocess as {alias.asname}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = ast.unparse(node.func.value), node.func.attr
        if (owner, name) in OTHER_PROCESSES or (
            owner == "os" and name.startswith(("exec", "spawn"))
        ):
            problems.append(f"{where}:{node.lineno} starts a process with {owner}.{name}")
            continue
        if owner == "asyncio" and name == "create_subprocess_exec":
            argv = list(node.args)
        elif owner == "subprocess" and name in SPAWNERS:
            first = node.args[0] if node.args else None
            argv = list(first.elts) if isinstance(first, (ast.List, ast.Tuple)) else []
        else:
            continue
        if renders_manifests(argv):
            continue
        code = snippet_of(argv, constants)
        if code is None:
            problems.append(
                f"{where}:{node.lineno} starts a process other than "
                "[sys.executable, '-c', <a snippet readable here>]"
            )
        else:
            snippet = ast.parse(code, f"{where}:{node.lineno} (snippet)")
            problems += import_problems(snippet, f"{where}:{node.lineno} (snippet)", CLI)
            problems += process_problems(snippet, f"{where}:{node.lineno} (snippet)")
    return problems


def import_problems(tree: ast.AST, where: str, also: frozenset[str] = frozenset()) -> list[str]:
    banned = MODEL_MODULES | SLOWER_TIERS | also
    hits = sorted(
        {(line, module) for module, line in imported_modules(tree) if within(module, banned)}
    )
    # `from pkg import name` names pkg and pkg.name: one line per import, the shorter name
    kept = [
        (line, module)
        for line, module in hits
        if not any(other == line and module.startswith(m + ".") for other, m in hits)
    ]
    return [f"{where}:{line} imports {module}" for line, module in kept]


def fixture_problems(tree: ast.AST, where: str) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        # pytest fills the arguments of tests and fixtures only: a helper's `hf` is a plain name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            node.name.startswith("test")
            or any("fixture" in ast.unparse(d) for d in node.decorator_list)
        ):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            problems += [
                f"{where}:{node.lineno} {node.name} asks for the {a.arg!r} fixture"
                for a in args
                if a.arg in MODEL_FIXTURES
            ]
        # request.getfixturevalue("hf"), pytest.mark.usefixtures("checkpoints")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("getfixturevalue", "usefixtures"):
                problems += [
                    f"{where}:{node.lineno} {node.func.attr}({arg.value!r})"
                    for arg in node.args
                    if isinstance(arg, ast.Constant) and arg.value in MODEL_FIXTURES
                ]
    return problems


def module_path(module: str) -> Path | None:
    """The file of a ``tests`` module, or None for a package or anything else."""
    path = REPO.joinpath(*module.split(".")).with_suffix(".py")
    return path if module.startswith("tests.") and path.is_file() else None


def tier_problems(path: Path) -> list[str]:
    """What keeps ``path`` (and the ``tests`` helpers it reaches) out of the fast tier."""
    problems, todo, seen = [], [path], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        tree = ast.parse(current.read_text(encoding="utf-8"), str(current))
        where = str(current.relative_to(REPO) if current.is_relative_to(REPO) else current)
        if current != path:
            where += f" (imported by {path.name})"
        problems += import_problems(tree, where)
        problems += fixture_problems(tree, where)
        problems += process_problems(tree, where)
        # a helper of tests/ is followed; a banned module is reported above, not walked, and
        # tests/unit's own modules are checked as themselves
        todo += [
            p
            for module, _ in imported_modules(tree)
            if not within(module, MODEL_MODULES | SLOWER_TIERS)
            and (p := module_path(module))
            and not p.is_relative_to(UNIT)
        ]
    return problems


def test_the_fast_tier_is_model_free_and_starts_no_stack() -> None:
    bad = [problem for path in sorted(UNIT.rglob("*.py")) for problem in tier_problems(path)]
    assert not bad, "move these to tests/engine or tests/integration:\n" + "\n".join(bad)


def test_the_check_sees_each_kind_of_breach(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import subprocess, sys, os\n"
        "def test_a(llama_dir):\n"
        "    from transformers import AutoModel\n"
        "def test_b(request):\n"
        "    request.getfixturevalue('hf')\n"
        "    subprocess.run([sys.executable, '-m', 'pdserve.cli', 'up'])\n"
        "    subprocess.run([sys.executable, '-c', 'import pdserve.cli'])\n"
        "    subprocess.run([sys.executable, '-c', 'print(1)'])\n"
        "    os.system('nats-server')\n"
        "from tests.engine.test_engine import x\n"
    )
    found = "\n".join(tier_problems(module))
    assert "2 test_a asks for the 'llama_dir' fixture" in found
    assert ":3 imports transformers" in found
    assert ":5 getfixturevalue('hf')" in found
    assert ":6 starts a process other than" in found
    assert ":7 (snippet):1 imports pdserve.cli" in found
    assert ":8 " not in found  # a fresh interpreter on a snippet that keeps the rules
    assert ":9 starts a process with os.system" in found
    assert ":10 imports tests.engine.test_engine" in found
