"""The production kernel variants (float and quantized KV cache) compile for sm_90 (H100/H200), fit
in shared memory and do not spill, checked on CPU with the ptxas that ships with Triton (see
compile_sm90.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.compile_sm90 import SM90_SHARED_MEMORY

REPO = Path(__file__).resolve().parents[2]


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton build ships no ptxas")
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated to silence its warning
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_sm90"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in reports}
    assert {"rms_norm", "rotary", "store_kvcache", "decode_merge"} <= kernels
    assert {"decode single_split=True", "prefill paged=True", "prefill paged=False"} <= kernels
    assert "decode single_split=False multi_query rows=64" in kernels
    for kv in ("int8", "fp8_e4m3"):  # --kv-cache-dtype: the quantized-cache variants
        assert f"store_kvcache kv={kv}" in kernels
        assert f"decode single_split=False kv={kv}" in kernels
        assert f"decode single_split=True multi_query rows=64 kv={kv}" in kernels
        assert f"prefill paged=True kv={kv}" in kernels
    for r in reports:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= SM90_SHARED_MEMORY, r
