"""Kernel tests run the Triton kernels on CPU through the Triton interpreter (CI), or compiled on
a GPU when PDSERVE_KERNEL_TEST_DEVICE=cuda (perf/gpu_check.sh).

The interpreter is chosen when a kernel is decorated, i.e. when its module is imported, so the
switch must be set here, before any test module imports kernels.triton_*.
"""

import os
import sys

if os.environ.get("PDSERVE_KERNEL_TEST_DEVICE", "cpu") == "cpu":
    already = [name for name in sys.modules if name.startswith("pdserve.kernels.triton_")]
    if already and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{already} imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402


@pytest.fixture
def kernel_backend():
    """Select ``pdserve.kernels.ops``' backend for one test: ``kernel_backend("triton")``."""
    from pdserve.kernels import ops

    previous = ops.set_backend("auto")
    yield ops.set_backend
    ops.set_backend(previous)
