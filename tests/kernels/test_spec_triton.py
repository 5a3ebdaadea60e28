"""Speculative verification rows through the Triton kernels (the path a GPU runs), here under the
Triton interpreter on the CPU: a subprocess with TRITON_INTERPRET=1 and PDSERVE_KERNELS=triton
runs the engine with n-gram drafts, and generates what the plain-torch kernels generate."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.shared.sampling import SamplingParams
from tests.engine.test_spec_engine import NGRAM, repeating_prompts
from tests.engine_support import make_engine

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 10

SCRIPT = """
import json, sys
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine
from tests.engine.test_spec_engine import NGRAM, repeating_prompts
engine = make_engine(sys.argv[1], dtype="float32", **NGRAM)
prompts = repeating_prompts(3, seed=4)
sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
outs = engine.generate(prompts, sp)
spec = engine.stats().spec
print(json.dumps({"outputs": outs, "accepted": spec.accepted_tokens, "drafts": spec.drafts}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_verification_through_the_triton_kernels(llama_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(TRITON_INTERPRET="1", PDSERVE_KERNELS="triton", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(llama_dir), str(MAX_TOKENS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    triton = json.loads(proc.stdout.strip().splitlines()[-1])
    assert triton["drafts"] > 0 and triton["accepted"] > 0
    torch_engine = make_engine(llama_dir, dtype="float32", **NGRAM)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert triton["outputs"] == torch_engine.generate(repeating_prompts(3, seed=4), sp)
