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
    # the LM head split by vocabulary rows, its logits gathered on rank 0 (--tp-lm-head)
    vocab_parallel: bool = False
    reduce_seconds: float = field(default=0.0, compare=False)
    reduce_calls: int = field(default=0, compare=False)
    gather_seconds: float = field(default=0.0, compare=False)

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

    def vocab(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """(first, last + 1, rows): this rank's vocabulary rows of the LM head. Every rank has
        ``rows`` (the last one zero-padded) so the gather's pieces are the same size."""
        if self.size == 1 or not self.vocab_parallel:
            return 0, cfg.vocab_size, cfg.vocab_size
        rows = -(-cfg.vocab_size // self.size)
        lo = self.rank * rows
        return lo, min(cfg.vocab_size, lo + rows), rows

    def gather_vocab(self, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: every rank's logits slice ``t`` [N, rows] joined into [N, vocab]; the other
        ranks send theirs and get ``t`` back (nobody reads it)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.group.gather([parts] if parts is not None else [], [t], opts).wait()
        self.gather_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=1)[:, :vocab_size] if parts is not None else t

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (a row-parallel layer's partial outputs)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        self.group.allreduce([t]).wait()
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
    if name.startswith("lm_head."):  # vocabulary rows, zero-padded to the same count
        lo, hi, rows = shard.vocab(cfg)
        part = t[lo:hi]
        if hi - lo < rows:
            part = torch.cat([part, part.new_zeros(rows - (hi - lo), *part.shape[1:])])
        return part
    return t  # embedding, norms, LM head: whole on every rank
