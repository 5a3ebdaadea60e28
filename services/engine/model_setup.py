"""The model and its paged KV cache as one rank holds them: what the engine (rank 0) and every
other tensor-parallel rank (``rank_process.py``) build the same way from the same config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pdserve.kernels import cpu_gemv
from pdserve.services.engine import few_rows
from pdserve.services.engine.huge_pages import move_to_huge_pages
from pdserve.services.engine.loader import load_model
from pdserve.services.engine.model import Attention, Linear, LlamaForCausalLM
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.quant.kv_cache import KVCacheSpec, kv_cache_spec
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.transfer.heads import Split

log = logging.getLogger(__name__)


def cache_spec(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, shard: Shard
) -> KVCacheSpec:
    """This rank's KV-cache geometry: its own KV heads only."""
    lo, hi = shard.kv_heads(cfg)
    return kv_cache_spec(
        config.kv_cache_dtype, dtype, cfg.num_layers, config.block_size, hi - lo, cfg.head_dim
    )


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


# float dtypes whose one-row matmul the BLAS runs faster from column-major weights (measured for
# float32; float64 is the tests' dtype and follows it, so tests run the served layout)
COLUMN_MAJOR_DTYPES = (torch.float32, torch.float64)


def lay_out_for_gemv(model: nn.Module, device: torch.device) -> None:
    """Store each float linear weight [N, K] column-major on a CPU: the same tensor, shape and
    values, its memory the contiguous [K, N] transpose.

    Batch-1 decode is one GEMV per layer. MKL's GEMV over a row-major weight read it at
    ~15 GB/s on this CPU, against ~21 GB/s for a plain sum of the same memory; over the
    transposed storage (``x @ W.T`` as an "NN" GEMM) it reads at the sum's speed: 26 against
    37 ms for SmolLM2-135M's weights at one row, one thread, and equal from 64 rows up
    (perf/README, "Decode at the memory roof"). A tied LM head shares the embedding's
    storage, so the embedding gathers strided rows: a few KiB per token, nothing next to it."""
    if device.type != "cpu":
        return
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or weight is None:
            continue
        if weight.dtype in COLUMN_MAJOR_DTYPES and weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()


def use_cpu_gemv(model: nn.Module, device: torch.device) -> None:
    """Route few-row (decode) matmuls over CPU weights to ``kernels/cpu_gemv``: bfloat16 and
    column-major float32 linears here, INT8 ones in ``CpuInt8Linear`` itself. Builds the kernel
    now, while the model loads, so no step waits for the compiler; where it cannot build,
    nothing changes. The compiled decode step's attention takes the extension's op too.
    On the AVX2 CPU of issue 42 (one thread) oneDNN's bf16 matmul read its weights at ~40% of a
    plain sum of the same bytes, the kernel at ~65% (perf/README.md)."""
    if device.type != "cpu":
        return
    modules = list(model.modules())
    bf16 = [m for m in modules if isinstance(m, Linear) and m.weight.dtype == torch.bfloat16]
    # float32 weights laid out column-major (lay_out_for_gemv): 1-24 rows through the kernel
    f32 = [
        m
        for m in modules
        if isinstance(m, Linear)
        and m.weight.dtype == torch.float32
        and m.weight.t().is_contiguous()
    ]
    if not cpu_gemv.available():
        return
    for module in bf16:  # the bf16 kernel reads row-major weights
        module._bf16_gemv = module.weight.is_contiguous()
    for module in f32:
        module._f32_colmajor = True
    for module in modules:  # a compiled decode step's attention: the C++ op over the pages
        if isinstance(module, Attention):
            module._cpu_paged_attention = True


def pack_for_gemm(model: nn.Module) -> int:
    """Give every column-major float32 CPU linear (``use_cpu_gemv``'s) a oneDNN-packed copy for
    its GEMMs of 5 rows and more (kernels/cpu_packed_gemm.cpp and cpu_gemv.h say why); returns
    the bytes the copies hold. Nothing where the extension or oneDNN is missing."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear) and module._f32_colmajor:
            if not cpu_gemv.can_pack_gemm(module.weight):
                continue
            module._packed_gemm = cpu_gemv.pack_gemm(module.weight)
            total += module.weight.numel() * module.weight.element_size()
    if total:
        log.info("float32 linears: %.0f MiB packed for oneDNN's GEMM", total / (1 << 20))
    return total


def choose_few_row_forms(model: LlamaForCausalLM, device: torch.device) -> None:
    """Time the few-rows matmul forms (``few_rows.py``) on a decoder layer while the model
    loads, and pack the LM head where packing won: a step that first meets 2-7 rows (a decode
    batch, a batch of prompts' last tokens at the head) must not time a 113 MB head."""
    if device.type != "cpu" or not model.layers:
        return
    probe = model.decoder_layers()[0].mlp.gate_up_proj
    if isinstance(probe, Linear):
        few_rows.choose_forms(probe.weight)
    if isinstance(model.lm_head, Linear):
        model.lm_head.prepare_few_rows()


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
    lay_out_for_gemv(model, device)
    if config.huge_pages and device.type == "cpu":
        move_to_huge_pages(model)
    use_cpu_gemv(model, device)
    if config.cpu_packed_gemm:
        pack_for_gemm(model)
    choose_few_row_forms(model, device)
    spec = cache_spec(config, cfg, dtype, shard)
    num_blocks = num_blocks_for(config, spec)
    kv_cache = spec.allocate(num_blocks, device, huge_pages=config.huge_pages)
    model.kv_spec = spec
    max_model_len = min(
        config.max_model_len or cfg.max_position_embeddings, num_blocks * config.block_size
    )
    model.init_rope(max_model_len, device)
    return RankModel(
        model=model,
        kv_spec=spec,
        kv_cache=kv_cache,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )
