"""The engine's step makes one device-to-host sync, reading the sampled tokens: every other
fact the host needs about a batch comes from its own lists. Checked on the CPU by recording
every tensor method that would sync on a GPU when the engine's own code calls it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from pdserve.services.engine import model_runner
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine

# where the engine's code is loaded from (build/'s link tree, in the editable install)
ENGINE_DIR = str(Path(model_runner.__file__).parent)
SYNCING = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class SyncSpy(TorchFunctionMode):
    """Records (function, engine file:line) for syncing tensor methods the engine calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(ENGINE_DIR):
                where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                self.calls.append((func.__name__, where))
        return func(*args, **(kwargs or {}))


def test_a_step_syncs_once_for_the_sampled_tokens(llama_dir):
    engine = make_engine(llama_dir, max_num_batched_tokens=256)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=4, seed=3)
    engine.add_request("cached", list(range(5, 45)), sampling)
    while engine.has_unfinished():
        engine.step()
    # a mixed step: a prefill on a cached prefix (prefix cache) beside a decode
    engine.add_request("decoding", list(range(100, 120)), sampling)
    engine.step()
    engine.add_request("prefix", list(range(5, 45)) + [7, 8, 9], sampling)
    for _ in range(3):
        with SyncSpy() as spy:
            engine.step()
        forward = [c for c in spy.calls if c[1].startswith("model_runner")]
        assert [name for name, _ in forward] == ["cpu"], spy.calls
