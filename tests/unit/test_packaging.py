"""One import namespace: pdserve installs `pdserve` and nothing else, and its folders never shadow
a third-party package of the same name (Hugging Face's `kernels`, which transformers >= 5.25
imports, broke collection when our `kernels/` won).

The editable install is checked here, without starting a process; importing both `kernels`
side by side, and a non-editable install into a fresh venv that already holds Hugging Face's
`kernels`, are tests/integration/test_install.py.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("gateway", "services", "shared", "kernels")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_folders_are_namespace_portions_not_packages() -> None:
    """A folder of the root with an __init__.py is a regular package `kernels` to anything run
    from the root, and a regular package found first on sys.path wins over site-packages."""
    assert not [f for f in FOLDERS if (REPO / f / "__init__.py").exists()]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """setuptools gets an explicit package list (the names differ from the folders): a new
    subpackage left out of it would be missing from the wheel."""
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {
        "pdserve." + ".".join(d.relative_to(REPO).parts)
        for folder in FOLDERS
        for d in [REPO / folder, *(REPO / folder).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }
    assert listed == on_disk | {"pdserve"}


def test_the_root_holds_one_module_the_cli() -> None:
    """`pdserve` itself is the repository root (so the CLI, above every layer, is `pdserve.cli`):
    any other .py file there would ship in the wheel as `pdserve.<name>`."""
    assert sorted(p.name for p in REPO.glob("*.py")) == ["cli.py"]


def link_tree() -> tuple[md.Distribution, Path]:
    """The editable install (`make setup`) and the tree of links its .pth puts on sys.path."""
    # the installed one, not the pdserve.egg-info an editable build leaves in the root
    installed = [
        (dist, pth)
        for dist in md.distributions(name="pdserve")
        for pth in dist.files or []
        if pth.name.startswith("__editable__") and pth.name.endswith(".pth")
    ]
    assert installed, "pdserve is not installed editable (make setup does that)"
    [(dist, pth)] = installed
    tree = Path(dist.locate_file(pth)).read_text().strip()
    # strict mode: a path (the default mode's import hook is a line of code no static tool runs)
    assert Path(tree).is_dir(), f"not a strict editable install: {tree!r} (make setup does that)"
    return dist, Path(tree)


def test_the_editable_install_holds_the_pdserve_namespace_only() -> None:
    """Strict mode: build/ holds `pdserve/`, a tree of links, which pyright, jedi and Python all
    find on sys.path; an implicit namespace, like the folders it maps."""
    dist, tree = link_tree()
    assert dist.read_text("top_level.txt").split() == ["pdserve"]
    assert tree.parent == REPO / "build"
    assert [p.name for p in tree.iterdir()] == ["pdserve"]
    assert not (tree / "pdserve" / "__init__.py").exists()
    assert {p.name for p in (tree / "pdserve").iterdir()} >= {"cli.py", *FOLDERS}
    # and the console script comes from the namespace
    [script] = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert (script.name, script.value) == ("pdserve", "pdserve.cli:main")


def test_the_link_tree_holds_every_module_as_it_is() -> None:
    """A module added, moved or removed since the tree was laid is missing from `pdserve`, or
    lingers in it, until `make setup` lays it again (any make target does)."""
    _, tree = link_tree()
    modules = {
        p.relative_to(REPO)
        for folder in FOLDERS
        for p in (REPO / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    } | {Path("cli.py")}
    linked = {p.relative_to(tree / "pdserve"): p for p in (tree / "pdserve").rglob("*.py")}
    stale = sorted(str(p) for p in modules ^ {p for p, link in linked.items() if link.exists()})
    assert not stale, f"build/'s link tree is out of date, `make setup` lays it again: {stale}"
    assert all(linked[p].resolve() == REPO / p for p in modules)
