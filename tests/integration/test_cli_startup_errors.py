"""A role that cannot start says why in one line, never a traceback: the real `pdserve` CLI in its
own process, for a broken GGUF (gateway) and for speculative options that only clash once the
environment is read (decode). The checks behind them are model-free and live in tests/unit
(test_spec_ngram.py) and tests/engine (test_gguf_cache.py); here the process's exit is tested."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.gguf_files import tiny_llama_256, write_gguf

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any PDSERVE_ setting a developer may have exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return {**env, **extra}


def test_cli_prints_one_line_not_a_traceback(tmp_path) -> None:
    good = write_gguf(tiny_llama_256(tmp_path / "wide"), tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    env = clean_env(PDSERVE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "gateway", "--model", str(cut)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pdserve gateway:")]
    assert len(errors) == 1 and str(cut) in errors[0] and "truncated" in errors[0]


def test_cli_says_what_is_wrong_in_one_line() -> None:
    env = clean_env(PDSERVE_NGRAM_MIN="6")  # from the environment, past argparse's checks
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--speculative", "ngram"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "pdserve decode: --ngram-min (6) exceeds --ngram-max (4)"
