"""One import namespace: pdserve installs `pdserve` and nothing else, and its folders never shadow
a third-party package of the same name (Hugging Face's `kernels`, which transformers >= 5.25
imports, broke collection when our `kernels/` won).

The editable install is checked here, without starting a process; importing both `kernels`
side by side, and a non-editable install into a fresh venv that already holds Hugging Face's
`kernels`, are tests/integration/test_install.py.
"""

from __future__ import annotations

import ast
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


def test_the_editable_install_maps_only_the_pdserve_namespace() -> None:
    # the installed one, not the pdserve.egg-info an editable build leaves in the root
    installed = [
        (dist, finder)
        for dist in md.distributions(name="pdserve")
        for finder in dist.files or []
        if finder.name.endswith("_finder.py")
    ]
    assert installed, "pdserve is not installed editable (make setup does that)"
    [(dist, finder)] = installed
    assert dist.read_text("top_level.txt").split() == ["pdserve"]
    tree = ast.parse(Path(dist.locate_file(finder)).read_text())
    tables = {
        node.target.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value
        if node.target.id in ("MAPPING", "NAMESPACES")
    }
    # `pdserve` is the root (for pdserve.cli); the four folders hang under it as namespaces
    assert tables["MAPPING"] == {"pdserve": str(REPO)}
    assert {f"pdserve.{f}" for f in FOLDERS} <= set(tables["NAMESPACES"])
    assert {name.split(".")[0] for name in tables["NAMESPACES"]} == {"pdserve"}
    # and the console script comes from the namespace
    [script] = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert (script.name, script.value) == ("pdserve", "pdserve.cli:main")
