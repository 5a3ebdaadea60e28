"""Which part of the model a rank holds, and the all-reduce that joins row-parallel outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pdserve.services.engine.model_config import ModelConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.kv.tp_layout import head_range, kv_head_range, tp_problem


@dataclass
class Shard:
    """Rank ``rank`` of ``size``; ``group`` is its torch.distributed process group (None at
    TP 1). ``reduce_seconds`` adds up the time spent in all-reduces (perf/tp_bench.py)."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    reduce_seconds: float = field(default=0.0, compare=False)
    reduce_calls: int = field(default=0, compare=False)

    def check(self, cfg: ModelConfig) -> None:
        problem = tp_problem(cfg.num_heads, cfg.num_kv_heads, self.size)
        if problem is None and cfg.intermediate_size % self.size:
            problem = (
                f"the MLP's {cfg.intermediate_size} channels are not divisible by "
                f"--tensor-parallel-size {self.size}"
            )
        if problem is not None:
            raise StartupError(problem)

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        return head_range(cfg.num_heads, self.size, self.rank)

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        return kv_head_range(cfg.num_kv_heads, self.size, self.rank)

    def channels(self, cfg: ModelConfig) -> tuple[int, int]:
        """The MLP's intermediate channels of this rank."""
        per = cfg.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (a row-parallel layer's partial outputs)."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self.reduce_seconds += time.perf_counter() - t0
        self.reduce_calls += 1
        return t


SINGLE = Shard()


def shard_piece(
    name: str, index: int, t: torch.Tensor, cfg: ModelConfig, shard: Shard
) -> torch.Tensor:
    """This rank's slice of checkpoint tensor ``index`` of our parameter ``name`` (the loader
    concatenates a fused parameter's pieces after slicing each)."""
    if shard.size == 1:
        return t
    d = cfg.head_dim
    if ".qkv_proj." in name:  # pieces q, k, v: output rows by head
        lo, hi = shard.heads(cfg) if index == 0 else shard.kv_heads(cfg)
        return t[lo * d : hi * d]
    if ".gate_up_proj." in name:  # pieces gate, up: output rows by channel
        lo, hi = shard.channels(cfg)
        return t[lo:hi]
    if name.endswith("o_proj.weight"):  # input columns by head
        lo, hi = shard.heads(cfg)
        return t[:, lo * d : hi * d]
    if name.endswith("down_proj.weight"):
        lo, hi = shard.channels(cfg)
        return t[:, lo:hi]
    return t  # embedding, norms, LM head: whole on every rank


def shard_columns(name: str) -> bool:
    """Whether ``name``'s weight is cut along its input columns (row-parallel)."""
    return name.endswith(("o_proj", "down_proj", "o_proj.weight", "down_proj.weight"))
