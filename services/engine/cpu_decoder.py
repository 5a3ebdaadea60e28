"""A decode step of a few rows on a CPU as one C++ call over every layer (kernels/cpu_decode.cpp).

The compiled decode step (``decode_graph.py``) runs one Inductor graph per layer. At batch 1 the
layers' weights stream in ~17 ms (float32 SmolLM2, one thread), and calling 30 graphs added
~3-4 ms: Dynamo's guards, AOTAutograd's wrappers, Inductor's Python wrapper, five op calls a
layer. The C++ decoder holds every layer's weights and pages, the token embedding and the final
norm, and runs the same arithmetic in one loop from token ids to the hidden states the LM head
reads: what llama.cpp's graph does, and what puts batch-1 decode at the weights' read time.

It serves the rows the graphs would (decode and verification tokens, not padded: it has no shapes
to specialise) where every projection is one the few-row kernels read: float32 column-major
(``Linear._f32_colmajor``) or INT8 (``CpuInt8Linear``) under float32 activations, bfloat16
(``Linear._bf16_gemv``) under bfloat16 ones (rounded where the eager model rounds), and no LoRA.
Float32 weights with oneDNN-packed copies (``--cpu-packed-gemm``) take it at any row count: from
``cpu_gemv.PACKED_FROM_ROWS`` rows their products run on the copies, and a batch of 32 ran
1.14-1.19x as fast as through the graphs, 64 level to 1.2x (``perf.roofline_bench``, two
threads). Without copies float32 takes it up to ``cpu_gemv.MAX_GEMM_ROWS`` rows, bfloat16 up to
``cpu_gemv.MAX_BF16_ROWS`` (the kernels read the weight once for all of them: a speculative
verification of 4 drafts stays here), INT8 up to ``cpu_gemv.MAX_ROWS`` (where fbgemm's GEMM
catches up). More rows, other dtypes and adapters keep the graphs. ``--no-cpu-fused-decode``
turns it off (the graphs then serve every bucket).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from pdserve.kernels import cpu_gemv
from pdserve.services.engine.model import DecoderLayer, Linear, LlamaForCausalLM
from pdserve.services.engine.quant.int8_linear import CpuInt8Linear

MAX_ROWS = cpu_gemv.MAX_ROWS  # INT8's kernel: the fewest rows any projection's kernel takes
ANY_ROWS = sys.maxsize  # a projection that takes a step of any width


def max_rows(model: LlamaForCausalLM) -> int:
    """The most rows of a step the C++ decoder of ``model`` serves (see the module): the fewest
    its projections' kernels take in one pass over their weights."""
    limits = [_rows_of(m) for layer in model.decoder_layers() for m in _projections(layer)]
    return min(limits, default=MAX_ROWS)


def _projections(layer: DecoderLayer) -> tuple[nn.Module, ...]:
    """A decoder layer's four linears, in the order ``CpuDecoder.add_layer`` takes them."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _rows_of(linear: nn.Module) -> int:
    if isinstance(linear, Linear) and linear._bf16_gemv:
        return cpu_gemv.MAX_BF16_ROWS
    if isinstance(linear, Linear) and linear._f32_colmajor:
        return ANY_ROWS if linear._packed_gemm is not None else cpu_gemv.MAX_GEMM_ROWS
    return MAX_ROWS  # INT8


def _projection(linear: nn.Module, dtype: torch.dtype) -> list[torch.Tensor | None] | None:
    """(weight, scale, inv_smooth, bias) of a projection the C++ decoder can run in a model of
    ``dtype`` (float32 or bfloat16 activations), else None."""
    if isinstance(linear, Linear):
        runs = linear._bf16_gemv if dtype == torch.bfloat16 else linear._f32_colmajor
        return [linear.weight, None, None, linear.bias] if runs else None
    if dtype == torch.bfloat16:
        return None
    if isinstance(linear, CpuInt8Linear) and linear.out_dtype == torch.float32:
        return [linear.qweight, linear.scale, linear.inv_smooth, linear.bias]
    return None


def build(model: LlamaForCausalLM) -> Any | None:
    """The model's C++ decoder, or None where a layer has a projection or norm it cannot run."""
    layers = model.decoder_layers()
    if not layers or not cpu_gemv.available():
        return None
    first = layers[0].self_attn
    dtype = layers[0].input_layernorm.weight.dtype  # the activations'
    eps = layers[0].input_layernorm.eps
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    decoder = None
    for layer in layers:
        attn = layer.self_attn
        parts = [_projection(m, dtype) for m in _projections(layer)]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (
            any(p is None for p in parts)
            or any(n.weight.dtype != dtype or n.eps != eps for n in norms)
            or attn.kv_pages.dtype != dtype
            or attn.kv_pages.dim() != 5
        ):
            return None
        if decoder is None:
            decoder = cpu_gemv._kernel().CpuDecoder(
                first.num_heads,
                first.num_kv_heads,
                first.head_dim,
                eps,
                first.scale,
                dtype == torch.bfloat16,
            )
        decoder.add_layer(norms[0].weight, norms[1].weight, attn.kv_pages, *parts)
    embedding, final_norm = model.embed_tokens.weight, model.norm
    if (
        decoder is None
        or embedding.dtype != dtype
        or final_norm.weight.dtype != dtype
        or final_norm.eps != eps
    ):
        return None
    decoder.set_ends(embedding, final_norm.weight)
    return decoder
