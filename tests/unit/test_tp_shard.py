"""How a rank's slices of the model are cut (services/engine/parallel/shard.py), model-free."""

from __future__ import annotations

import pytest
import torch

from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.parallel.shard import Shard, shard_piece


def config(vocab: int = 10, heads: int = 4, kv_heads: int = 2, inter: int = 12) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=8,
        intermediate_size=inter,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=False,
        eos_token_ids=(0,),
    )


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_vocab_rows_cover_the_vocabulary_once_and_pad_to_one_size(size):
    cfg = config()
    head = torch.arange(10 * 8, dtype=torch.float32).reshape(10, 8)
    pieces = [
        shard_piece("lm_head.weight", 0, head, cfg, Shard(r, size, vocab_parallel=True))
        for r in range(size)
    ]
    rows = -(-10 // size) if size > 1 else 10
    assert all(p.shape == (rows, 8) for p in pieces)
    joined = torch.cat(pieces)
    assert torch.equal(joined[:10], head) and not joined[10:].any()  # the padding is zeros


def test_a_replicated_head_is_whole_on_every_rank():
    cfg = config()
    head = torch.randn(10, 8)
    assert Shard(1, 2).vocab(cfg) == (0, 10, 10)
    assert torch.equal(shard_piece("lm_head.weight", 0, head, cfg, Shard(1, 2)), head)


def test_column_and_row_parallel_slices():
    cfg = config()
    shard = Shard(1, 2)
    q, k = torch.randn(8, 8), torch.randn(4, 8)  # 4 heads x 2, 2 KV heads x 2
    assert torch.equal(shard_piece("layers.0.self_attn.qkv_proj.weight", 0, q, cfg, shard), q[4:])
    assert torch.equal(shard_piece("layers.0.self_attn.qkv_proj.weight", 1, k, cfg, shard), k[2:])
    o = torch.randn(8, 8)
    assert torch.equal(shard_piece("layers.0.self_attn.o_proj.weight", 0, o, cfg, shard), o[:, 4:])
    down = torch.randn(8, 12)
    got = shard_piece("layers.0.mlp.down_proj.weight", 0, down, cfg, shard)
    assert torch.equal(got, down[:, 6:])
    # KV heads replicated past their number: TP 4 over 2 KV heads, ranks 2 and 3 hold head 1
    assert Shard(2, 4).kv_heads(cfg) == Shard(3, 4).kv_heads(cfg) == (1, 2)
