"""Hugging Face's `kernels` (which transformers >= 5.25 imports) and pdserve's side by side: in the
project venv, from the repository root and from elsewhere; and after a non-editable install
(`pip install .`, as a wheel) into a fresh venv that already holds theirs, where pdserve adds `pdserve/` and nothing else to site-packages, their
package is left byte for byte as it was, and `pdserve --help` runs.

Offline: the wheel is built with the project venv's setuptools, Hugging Face's package is copied
file by file from the project venv (its RECORD says which files), and the fresh venv finds the
other dependencies through a .pth line pointing at the project venv's site-packages - after its
own, so what is installed in the fresh venv wins.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "cli.py", "gateway", "services", "shared", "kernels")


def run(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def record_digest(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the sources, so the checkout gains no build/ or egg-info."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        out,
        src,
        cwd=src,
    )
    [built] = out.glob("pdserve-*.whl")
    return built


def test_the_wheel_holds_one_top_level_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        [dist_info] = {n.split("/")[0] for n in names if ".dist-info/" in n}
        top_level = zf.read(f"{dist_info}/top_level.txt").decode().split()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert top_level == ["pdserve"]
    assert {n.split("/")[0] for n in names} == {"pdserve", dist_info}
    assert "pdserve/__init__.py" not in names  # an implicit namespace, like its folders
    assert "pdserve = pdserve.cli:main" in entry_points
    # every module of the four folders made it in, and the data file the quantizer reads
    wanted = {
        "pdserve/" + p.relative_to(REPO).as_posix()
        for folder in SOURCES[2:]
        for p in (REPO / folder).rglob("*.py")
    }
    assert wanted <= set(names)
    assert "pdserve/services/engine/quant/calibration_text.txt" in names


def test_a_fresh_venv_with_hugging_face_kernels_keeps_both(wheel: Path, tmp_path: Path) -> None:
    theirs = md.distribution("kernels")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path
        ).stdout.strip()
    )
    # Hugging Face's kernels, installed there first (copied with its dist-info and RECORD)
    copied = []
    for file in theirs.files or []:
        source = Path(theirs.locate_file(file))
        if file.parts[0].startswith("..") or not source.is_file() or "__pycache__" in file.parts:
            continue
        (site / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, site / file)
        copied.append(file)
    (site / "project-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "-q",
        wheel,
        cwd=tmp_path,
    )

    # theirs: every file it recorded is still there, byte for byte
    changed = [
        str(file)
        for file in copied
        if file.hash and record_digest(site / file) != f"{file.hash.mode}={file.hash.value}"
    ]
    assert not changed and (site / "kernels" / "__init__.py").is_file()
    # ours: pdserve/ only
    assert (site / "pdserve" / "kernels" / "ops.py").is_file()
    assert not (site / "pdserve" / "__init__.py").exists()
    new = {p.name for p in site.iterdir()} - {f.parts[0] for f in copied} - {"project-deps.pth"}
    assert {n for n in new if not n.endswith(".dist-info")} == {"pdserve"}

    help_text = run(venv / "bin" / "pdserve", "--help", cwd=tmp_path).stdout
    assert "bench" in help_text and "doctor" in help_text
    check = (
        "import kernels, pdserve.kernels.ops as ops, pdserve.services.control.bench.cli\n"
        "from transformers import LlamaConfig\n"
        "from kernels import CUDAProperties\n"
        f"assert kernels.__file__.startswith({str(site)!r}), kernels.__file__\n"
        f"assert ops.__file__.startswith({str(site)!r}), ops.__file__\n"
    )
    run(python, "-c", check, cwd=tmp_path)


SIDE_BY_SIDE = """
import importlib.metadata as md, sys
from pathlib import Path
repo = Path(sys.argv[1])
version = tuple(int(p) for p in md.version("transformers").split(".")[:2])
assert version >= (5, 25), f"transformers {version}: too old to import kernels"
from transformers import LlamaConfig
from transformers.integrations import hub_kernels  # imports Hugging Face's `kernels`
import kernels
assert hasattr(kernels, "CUDAProperties"), kernels.__file__
assert Path(kernels.__file__).is_relative_to(Path(md.distribution("kernels").locate_file(""))), kernels.__file__
import pdserve.kernels.ops, pdserve.cli, pdserve.gateway.server, pdserve.services.control.launcher
assert Path(pdserve.kernels.ops.__file__).resolve() == repo / "kernels" / "ops.py"
print("ok", LlamaConfig.__name__, hub_kernels.__name__)
"""


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_hugging_face_kernels_and_ours_import_side_by_side(where: str, tmp_path: Path) -> None:
    """From the root (first on sys.path, as `python -m pytest` and `python -m perf.x` put it)
    and from anywhere else."""
    cwd = REPO if where == "root" else tmp_path
    proc = subprocess.run(
        [sys.executable, "-c", SIDE_BY_SIDE, str(REPO)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_the_cli_runs_as_a_module_from_the_root() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "doctor" in proc.stdout, proc.stderr[-3000:]
