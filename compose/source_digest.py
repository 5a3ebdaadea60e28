"""Print a digest of everything the image build reads from the repository.

`compose/build-image.sh` labels the image with it (org.pdserve.source-digest), and the container
test tiers compare the label with the working tree: an image left over from an older tree runs
older code, so its results would say nothing about this one (an old image speaking an older bus
protocol failed the podman tier in CI). Standard library only: it runs on the host's python3.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# What compose/Dockerfile copies (.dockerignore lets in only these), and the Dockerfile itself.
INPUTS = (
    "pyproject.toml",
    "README.md",
    "requirements.lock",
    "cli.py",
    "gateway",
    "services",
    "shared",
    "kernels",
    "compose/requirements.py",
    "compose/Dockerfile",
)
LABEL = "org.pdserve.source-digest"


def files(repo: Path) -> list[Path]:
    out: list[Path] = []
    for name in INPUTS:
        path = repo / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out += [p for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return out


def source_digest(repo: Path) -> str:
    h = hashlib.sha256()
    for path in files(repo):
        # The path as well as the bytes: a renamed module is another image.
        h.update(path.relative_to(repo).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:32]


if __name__ == "__main__":
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    print(source_digest(repo))
