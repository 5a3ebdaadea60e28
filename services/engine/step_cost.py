"""The engine's side of the roofline (``pdserve.shared.telemetry.roofline``): what this rank's
model is, as the roofline counts it, and the shape of each step's forward pass.

The model's shape comes from its ``ModelConfig`` and this rank's ``Shard`` (at tensor
parallelism N: its query and KV heads, its MLP channels, its rows of a vocab-parallel LM head);
what its weights take comes from the loaded modules themselves, so INT8 layers (per-channel or
GGUF Q8_0 group scales), layers kept in float (``quant.int8_linear.FLOAT_LINEARS``) and a tied
head all count as they are stored. The KV cache's bytes per token come from its ``KVCacheSpec``
(a quantized cache's per-token scales included).

A step's shape comes from the ``StepInputs`` the runner built for it (host lists: no device
sync, and no walk over the batch's ``Sequence`` objects): each row's new tokens and cached
context, and the positions whose logits the runner computes.
"""

from __future__ import annotations

from torch import nn

from pdserve.services.engine.logprobs import PROMPT_SLICE
from pdserve.services.engine.model import LlamaForCausalLM
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.model_runner import ModelRunner
from pdserve.services.engine.outputs import StepInputs
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.quant.int8_linear import CpuInt8Linear
from pdserve.services.engine.quant.kv_cache import KVCacheSpec
from pdserve.shared.telemetry.roofline import Cost, ModelCost, ModelShape, Storage, step_shape

FBGEMM_SCALE_BYTES = 4  # fbgemm's packed INT8 weight: a float32 scale per output channel


def stored_bytes(module: nn.Module) -> int:
    """Bytes a linear layer's forward reads of its own storage: a float weight (and bias), or
    INT8 values and their scales (and bias)."""
    if isinstance(module, CpuInt8Linear):  # the packed weight is opaque to torch
        bias = module.bias.nbytes if module.bias is not None else 0
        n, k = module.out_features, module.in_features
        return n * k + n * FBGEMM_SCALE_BYTES + bias
    # the float ``Linear`` holds weight and bias as parameters, the weight-only INT8 layer
    # its values, scales and bias as buffers
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(t.nbytes for t in tensors)


def model_cost(
    model: LlamaForCausalLM, cfg: ModelConfig, shard: Shard, kv_spec: KVCacheSpec
) -> ModelCost:
    """This rank's model as the roofline counts it (see the module docstring)."""
    heads_lo, heads_hi = shard.heads(cfg)
    kv_lo, kv_hi = shard.kv_heads(cfg)
    ch_lo, ch_hi = shard.channels(cfg)
    shape = ModelShape(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=heads_hi - heads_lo,
        num_kv_heads=kv_hi - kv_lo,
        head_dim=cfg.head_dim,
        intermediate_size=ch_hi - ch_lo,
        lm_head_rows=model.lm_head.out_features,  # replicated: all; vocab-parallel: this rank's
    )
    layers = sum(
        stored_bytes(linear)
        for layer in model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    )
    embedding = model.embed_tokens.weight
    storage = Storage(
        layer_weight_bytes=float(layers),
        lm_head_bytes=float(stored_bytes(model.lm_head)),
        embedding_row_bytes=float(embedding.shape[1] * embedding.element_size()),
        kv_token_bytes=kv_spec.bytes_per_block / kv_spec.block_size,
    )
    return ModelCost(shape, storage)


class StepCost:
    """Each step's FLOPs and bytes: O(rows) arithmetic over the runner's host lists."""

    def __init__(self, model: ModelCost, prefill_reads_cache: bool) -> None:
        self.model = model
        # prompt chunks attend through the pages with a quantized cache (``ModelRunner``)
        self.prefill_reads_cache = prefill_reads_cache

    @classmethod
    def of_runner(cls, runner: ModelRunner, cfg: ModelConfig, shard: Shard) -> StepCost:
        """The step cost of the passes ``runner`` makes with this rank's model."""
        model = runner.model
        return cls(model_cost(model, cfg, shard, model.kv_spec), runner.prefill_reads_cache)

    def of(self, inputs: StepInputs) -> Cost:
        """The cost of the forward pass the runner made of ``inputs``."""
        counts, starts = inputs.counts, inputs.starts
        num_paged = inputs.num_decodes + inputs.num_verifies  # decode attention reads pages
        # the runner attends a prefill group through the pages when any row has cached context
        prefill_paged = self.prefill_reads_cache or any(st > 0 for st in starts[num_paged:])
        # logits: the sampled rows in one call, then prompt log-prob rows in PROMPT_SLICE slices
        prompt_rows = len(inputs.read) - inputs.num_sampled
        calls = (inputs.num_sampled > 0) + -(-prompt_rows // PROMPT_SLICE)
        shape = step_shape(counts, starts, num_paged, prefill_paged, len(inputs.read), calls)
        return self.model.cost(shape)
