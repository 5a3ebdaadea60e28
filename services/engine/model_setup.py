"""The model and its paged KV cache as one rank holds them: what the engine (rank 0) and every
other tensor-parallel rank (``parallel/rank.py``) build the same way from the same config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.services.engine.loader import load_model
from pdserve.services.engine.model import LlamaForCausalLM
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.quant.kv_cache import KVCacheSpec, kv_cache_spec
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.transfer.heads import Split


def cache_spec(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, shard: Shard
) -> KVCacheSpec:
    """This rank's KV-cache geometry: its own KV heads only."""
    lo, hi = shard.kv_heads(cfg)
    return kv_cache_spec(config.kv_cache_dtype, dtype, cfg.num_layers, config.block_size,
                         hi - lo, cfg.head_dim)  # fmt: skip


def num_blocks_for(config: EngineConfig, spec: KVCacheSpec) -> int:
    """``--num-kv-blocks``, else what ``--kv-cache-gib`` holds (per rank: a rank's blocks hold
    only its heads, so at TP N the same memory holds N times the blocks)."""
    return config.num_kv_blocks or max(
        1, int(config.kv_cache_gib * (1 << 30)) // spec.bytes_per_block
    )


def kv_parts(spec: KVCacheSpec) -> Split:
    """How the KV transfer cuts this cache's storage into parts with a heads dim (values, and
    a quantized cache's scales): what head-sliced pulls slice."""
    return lambda storage: [t for t in spec.split(storage) if t is not None]


@dataclass
class RankModel:
    model: LlamaForCausalLM
    kv_spec: KVCacheSpec
    # float: [blocks, layers, 2, block_size, kv_heads, head_dim]; quantized: [blocks, bytes]
    kv_cache: torch.Tensor
    num_blocks: int
    max_model_len: int


def build_rank_model(
    config: EngineConfig,
    cfg: ModelConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard,
) -> RankModel:
    torch.manual_seed(config.seed)
    model = load_model(model_dir, cfg, device, dtype, config.quantization, shard=shard)
    spec = cache_spec(config, cfg, dtype, shard)
    num_blocks = num_blocks_for(config, spec)
    kv_cache = spec.allocate(num_blocks, device)
    model.kv_spec = spec
    max_model_len = min(
        config.max_model_len or cfg.max_position_embeddings, num_blocks * config.block_size
    )
    model.init_rope(max_model_len, device)
    return RankModel(model, spec, kv_cache, num_blocks, max_model_len)
