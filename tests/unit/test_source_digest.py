"""compose/source_digest.py: the label that tells the container tiers an image is from this tree."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("source_digest", REPO / "compose/source_digest.py")
assert _spec is not None and _spec.loader is not None
_DIGEST = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_DIGEST)


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name in _DIGEST.INPUTS:
        src = REPO / name
        if src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, root / name)
        else:
            (root / name).mkdir(parents=True)
            (root / name / "mod.py").write_text("x = 1\n")
    return root


def test_a_source_edit_or_rename_changes_the_digest_and_bytecode_does_not(tmp_path: Path) -> None:
    root = tree(tmp_path)
    first = _DIGEST.source_digest(root)
    assert first == _DIGEST.source_digest(root)
    cache = root / "shared" / "__pycache__"
    cache.mkdir()
    (cache / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / "gateway" / "stale.pyc").write_bytes(b"\0")
    assert _DIGEST.source_digest(root) == first
    (root / "shared" / "mod.py").write_text("x = 2\n")
    edited = _DIGEST.source_digest(root)
    assert edited != first
    (root / "shared" / "mod.py").rename(root / "shared" / "other.py")
    assert _DIGEST.source_digest(root) not in (first, edited)
    (root / "compose" / "Dockerfile").write_text("FROM scratch\n")
    assert _DIGEST.source_digest(root) != first


def test_every_input_the_dockerfile_copies_is_digested() -> None:
    dockerfile = (REPO / "compose" / "Dockerfile").read_text()
    copied = {
        part.rstrip("/")
        for line in dockerfile.splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for part in line.split()[1:-1]
    }
    assert copied - {"compose/build-inputs"} <= set(_DIGEST.INPUTS), copied
