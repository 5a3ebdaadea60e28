"""What two engines must agree on for KV blocks to be copied as bytes between them: the layout
fingerprint an engine states (``LLMEngine.layout_fingerprint``), which a worker advertises by
name (``shared/kv/layout.layout_id``) and a KV handle carries."""

from __future__ import annotations

import torch

from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.quant.kv_cache import KVCacheSpec
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.tp_layout import TP_KEY


def kv_fingerprint(
    model_name: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    config: EngineConfig,
    shard: Shard,
    kv_spec: KVCacheSpec,
) -> dict[str, object]:
    """The fingerprint of an engine serving ``model_name`` at ``dtype`` over ``shard``'s ranks
    (its block size and model version from ``config``)."""
    return {
        "model": model_name,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        TP_KEY: shard.size,  # which heads each rank holds (shared/kv/tp_layout.py)
        **kv_spec.fingerprint(),  # element type and scale layout of the blocks
        **({"model_version": v} if (v := config.model_version) else {}),  # a rollout's
    }
