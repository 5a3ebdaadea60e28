"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Tokens of all scheduled sequences are packed into one flat batch with no padding. The first
``num_decodes`` sequences contribute one token each and use paged decode attention; then come
speculative verification rows (a sequence's last token and its drafts), then prefill chunks,
each group with varlen causal attention (reading any already-cached prefix from the pages).
All heavy ops go through ``pdserve.kernels.ops``, the one dispatch point between Triton and torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from pdserve.kernels import cpu_gemv, ops
from pdserve.services.engine.few_rows import FewRowsLinear
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.parallel.shard import SINGLE, Shard
from pdserve.services.engine.quant.kv_cache import KVCacheSpec


@dataclass
class ChunkGroup:
    """Rows of several query tokens each, attended with varlen causal attention: prefill chunks,
    or speculative verification rows (the last token and the drafts after it)."""

    num_tokens: int
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor | None  # None when no row has a cached prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int  # sequences in paged decode attention (the first ones)
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes]
    # ops.decode_plan of the two above: made once per forward pass, shared by every layer
    decode_plan: object | None
    # after the decodes' tokens: verification rows, then prefill chunks. They are attended
    # apart so short verification rows are never padded to a long prompt chunk.
    verify: ChunkGroup | None
    prefill: ChunkGroup | None
    # verification rows may instead join decode attention, several queries per sequence
    # (``verify`` is then None): the decode group's tokens, their cu_seqlens and longest row
    num_decode_tokens: int = 0
    decode_cu_seqlens_q: torch.Tensor | None = None
    decode_max_seqlen_q: int = 1
    # each token's LoRA slot [T] (services/engine/lora; 0: the base model), None when no token
    # of the step uses an adapter
    lora_slots: torch.Tensor | None = None


@dataclass
class GraphDecodeMetadata:
    """A decode step (one new token per row) as a compiled graph takes it: tensors only, the
    rows padded to a batch-size bucket (``services/engine/decode_graph.py``)."""

    kv_rows: torch.Tensor  # [2, B] where each new token's K and V go (graph_ops.kv_rows)
    block_tables: torch.Tensor  # [B, blocks]; the block count is a dynamic size of the graph
    context_lens: torch.Tensor  # [B] cached tokens of each row, its new one included
    lora_slots: torch.Tensor | None = None  # [B] each row's LoRA slot, where adapters are served


class Linear(nn.Linear):
    _few_rows: FewRowsLinear | None = None  # made at the first call, after loading
    # a bfloat16 CPU weight read by kernels/cpu_gemv.py at few rows (model_setup.use_cpu_gemv)
    _bf16_gemv: bool = False
    # a column-major float32 CPU weight read by kernels/cpu_gemv.py at 1-4 rows (same setup)
    _f32_colmajor: bool = False
    # its copy in oneDNN's layout for 5 rows and more (model_setup.pack_for_gemm), or None
    _packed_gemm: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_gemv:
            return cpu_gemv.bf16_linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # a compiled step: the form is fixed at trace time
            if self._f32_colmajor and x.dim() == 2:
                # one opaque op: the graph of batches 2 and up knows its row count only at run
                # time, and the op picks the kernel (1-4 rows) or F.linear then
                return cpu_gemv.f32_linear(x, self.weight, self.bias)
            return super().forward(x)
        packed = self._packed_gemm is not None
        if self._f32_colmajor and x.dim() == 2 and cpu_gemv.f32_rows(x.shape[0], packed):
            return cpu_gemv.f32_linear_now(x, self.weight, self.bias)
        if packed and x.dim() == 2:  # 5 rows and more: oneDNN on the copy
            return cpu_gemv.f32_linear(x, self.weight, self.bias)
        if self._few_rows is None or not self._few_rows.serves(self.weight):
            self._few_rows = FewRowsLinear(self.weight, self.bias)
        out = self._few_rows(x)
        return super().forward(x) if out is None else out

    def prepare_few_rows(self) -> None:
        """Make the few-rows forms now (and the packed copy, where packing won), not in a step."""
        if self._bf16_gemv:
            return
        self._few_rows = FewRowsLinear(self.weight, self.bias)
        self._few_rows.prepare()


def project(linear: nn.Module, x: torch.Tensor, lora_slots: torch.Tensor | None) -> torch.Tensor:
    """``linear(x)`` plus, where the step's tokens name adapters, each token's LoRA delta. The
    stacks are buffers ``lora_a``/``lora_b`` where adapters are served (lora/slots.py): buffers,
    so a compiled step takes them as inputs and sees adapters loaded after it was traced."""
    y = linear(x)
    a, b = getattr(linear, "lora_a", None), getattr(linear, "lora_b", None)
    if lora_slots is None or a is None or b is None:
        return y
    return y + ops.lora_delta(x, a, b, lora_slots)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    # a compiled decode step's attention through kernels/cpu_gemv.paged_attention, the C++ op
    # over the pages (model_setup.use_cpu_gemv): 1.3x Inductor's form at batch 16-64
    # (perf/paged_decode_bench.py)
    _cpu_paged_attention: bool = False

    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        # this rank's heads (all of them at TP 1): q/k/v are column-parallel, o row-parallel
        lo, hi = shard.heads(cfg)
        kv_lo, kv_hi = shard.kv_heads(cfg)
        self.shard = shard
        self.num_heads = hi - lo
        self.num_kv_heads = kv_hi - kv_lo
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v share one matmul; the loader concatenates the checkpoint's three tensors.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # a float cache's [blocks, 2, block_size, kv_heads, head_dim] view of this layer: K and
        # V as one tensor, what a compiled decode step takes (decode_graph.py)
        self.kv_pages = torch.empty(0)
        # a quantized cache's per-token-head scales [blocks, block_size, kv_heads, 1], else None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        meta: AttentionMetadata | GraphDecodeMetadata,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        qkv = project(self.qkv_proj, x, meta.lora_slots)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if isinstance(meta, GraphDecodeMetadata):
            return self._graph_decode(positions, q, k, v, meta, cos_sin)
        # q and k are strided views into qkv; rotary rotates them in place.
        ops.rotary_embedding(positions, q, k, cos_sin)
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **scales)
        nd = meta.num_decode_tokens or meta.num_decodes
        parts = []
        if nd:
            parts.append(
                ops.decode_attention(
                    q[:nd],
                    self.k_cache,
                    self.v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    meta.decode_plan,
                    meta.decode_cu_seqlens_q,
                    meta.decode_max_seqlen_q,
                    **scales,
                )
            )
        first = nd
        for group in (meta.verify, meta.prefill):
            if group is None:
                continue
            rows = slice(first, first + group.num_tokens)
            first += group.num_tokens
            paged = group.block_tables is not None
            parts.append(
                ops.prefill_attention(
                    q[rows],
                    k[rows],
                    v[rows],
                    group.cu_seqlens_q,
                    group.cu_seqlens_k,
                    group.max_seqlen_q,
                    group.max_seqlen_k,
                    self.scale,
                    self.k_cache if paged else None,
                    self.v_cache if paged else None,
                    group.block_tables,
                    **(scales if paged else {}),
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.shard.reduce(
            project(self.o_proj, out.reshape(-1, self.q_size), meta.lora_slots)
        )

    def _graph_decode(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: GraphDecodeMetadata,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """A compiled decode step's attention: rotary as new tensors (an in-place rotation of
        qkv's views reached the KV write unrotated once traced), the KV write as one opaque
        in-place op, then attention that reads the pages where they are, over the batch at once."""
        q, k = ops.rotated(positions, q, k, cos_sin)
        pages = self.kv_pages
        ops.store_kv_graph(k, v, pages, meta.kv_rows)
        if self._cpu_paged_attention and pages.dtype in (torch.float32, torch.bfloat16):
            out = cpu_gemv.paged_attention(
                q, pages, meta.block_tables, meta.context_lens, self.scale
            )
        else:
            out = ops.paged_decode_attention(
                q, pages[:, 0], pages[:, 1], meta.block_tables, meta.context_lens, self.scale
            )
        return self.shard.reduce(
            project(self.o_proj, out.reshape(-1, self.q_size), meta.lora_slots)
        )


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        lo, hi = shard.channels(cfg)  # gate/up column-parallel, down row-parallel
        self.shard = shard
        self.intermediate = hi - lo
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, lora_slots).split(self.intermediate, dim=-1)
        return self.shard.reduce(project(self.down_proj, nn.functional.silu(gate) * up, lora_slots))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, positions, h, residual, meta, cos_sin):
        if residual is None:
            residual, (h, _) = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, meta, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.lora_slots), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard  # the part of the model this rank holds (parallel/)
        kv_lo, kv_hi = shard.kv_heads(cfg)
        self.num_local_kv_heads = kv_hi - kv_lo  # what this rank's KV cache holds per token
        # whole on every rank: a vocab-parallel lookup would add an all-reduce per step
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        _, _, rows = shard.vocab(cfg)  # all of it, or this rank's rows (--tp-lm-head vocab)
        self.vocab_parallel = rows != cfg.vocab_size
        self.lm_head = Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings and not self.vocab_parallel:  # else the loader ties a slice
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        # how bind_kv_cache reads the engine's cache storage (services/engine/quant/kv_cache.py);
        # None: a plain float cache tensor
        self.kv_spec: KVCacheSpec | None = None
        # called with the count of layers written so far, during a forward pass whose KV a
        # prefill worker streams (services/engine/kv_stream.py); None otherwise
        self.layer_hook: Callable[[int], None] | None = None

    def init_rope(self, max_position: int, device: torch.device) -> None:
        cfg = self.cfg
        self.cos_sin = ops.build_rope_cache(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Point every layer at its K and V views (and scales) of the block-major cache."""
        values, scales = (kv_cache, None) if self.kv_spec is None else self.kv_spec.split(kv_cache)
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            attn.k_cache = values[:, i, 0]
            attn.v_cache = values[:, i, 1]
            attn.kv_pages = values[:, i]
            if scales is not None:
                attn.k_scale = scales[:, i, 0]
                attn.v_scale = scales[:, i, 1]

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (``nn.ModuleList`` yields plain modules to a type checker)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        output_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The final hidden states (normed) at ``output_indices`` of the flat token batch: the
        positions that sample, and any whose prompt log-probs are asked. ``compute_logits``
        turns them into logits, in slices the caller bounds."""
        h = self.embed_tokens(input_ids)
        residual = None
        hook = self.layer_hook  # layer-wise KV streaming: who hears of each layer written
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, meta, self.cos_sin)
            if hook is not None:
                hook(i + 1)
        # Only the positions that are read need the final norm and the (large) vocab projection.
        h, residual = h[output_indices], residual[output_indices]
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: [N, hidden] final hidden states -> [N, vocab] float32 logits. Vocab-
        parallel, every rank makes the same calls (``ModelRunner.follow_logits``) and rank 0
        gets the whole rows."""
        logits = self.lm_head(hidden).float()
        if self.vocab_parallel:
            return self.shard.gather_vocab(logits, self.cfg.vocab_size)
        return logits
