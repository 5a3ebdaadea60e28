from __future__ import annotations

import os
from pathlib import Path

import pytest

# Each test session gets its own demo-model cache unless the caller pins one.
os.environ.setdefault(
    "PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "pdserve")
)

# Tiers of real processes and networks (nats-server, UCX, HTTP, `pdserve up`, namespaces, docker):
# marked `slow` as a whole, so `pytest -m "not slow"` leaves the unit, engine and kernel tiers.
SLOW_TIERS = [
    Path(__file__).resolve().parent / tier
    for tier in ("integration", "multihost", "docker", "podman")
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.is_relative_to(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a tiny HF checkpoint (see tests/checkpoints.py)."""
    from tests.checkpoints import VARIANTS, build_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(name, root / name) for name in VARIANTS}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama-gqa"]


@pytest.fixture(scope="session")
def hf(llama_dir):
    """transformers on the tiny llama checkpoint: the oracle for log-probs and greedy output."""
    from tests.hf_reference import HFReference

    return HFReference(llama_dir)


@pytest.fixture(scope="session")
def hf_tok(llama_dir):
    """The checkpoint's own tokenizer and chat template, as transformers reads them."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(llama_dir))
