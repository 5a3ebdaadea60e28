"""The test image, made current: one built from another tree is rebuilt before a tier runs it.

An image left from an older tree runs older code: in CI one spoke an older bus protocol than the
test's own decoder, and the podman tier failed on that instead of on pdserve. `make image`
labels the image with compose/source_digest.py's digest; a tier compares it with the working
tree's and, where they differ, runs `make image` again (the Docker layer cache keeps that to the
source layers unless the dependencies changed). An image named by PDSERVE_TEST_IMAGE is the
user's choice and is run as it is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_IMAGE = "pdserve:latest-cpu"
IMAGE = os.environ.get("PDSERVE_TEST_IMAGE", DEFAULT_IMAGE)


def _digest_module():
    spec = importlib.util.spec_from_file_location(
        "source_digest", REPO / "compose/source_digest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_DIGEST = _digest_module()
LABEL: str = _DIGEST.LABEL


def tree_digest() -> str:
    return _DIGEST.source_digest(REPO)


def label_of(cli: str, env: dict[str, str] | None = None) -> str | None:
    """The image's source digest under `cli` (docker or podman): "" unlabelled, None absent."""
    done = subprocess.run(
        [cli, "image", "inspect", IMAGE], capture_output=True, text=True, env=env, timeout=60
    )
    if done.returncode != 0:
        return None
    info = json.loads(done.stdout)[0]
    # docker keeps labels under Config; podman has them at the top as well.
    labels = (info.get("Config") or {}).get("Labels") or info.get("Labels") or {}
    return labels.get(LABEL, "")


def is_current(cli: str, env: dict[str, str] | None = None) -> bool:
    return IMAGE != DEFAULT_IMAGE or label_of(cli, env) == tree_digest()


def rebuild(log: Path) -> str | None:
    """Run `make image` (docker must answer); None when it worked, else why it did not."""
    with log.open("w") as out:
        done = subprocess.run(
            ["make", "-C", str(REPO), "image"],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=False,
        )
    if done.returncode == 0:
        return None
    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
    return f"`make image` exited {done.returncode}:\n" + "\n".join(tail)
