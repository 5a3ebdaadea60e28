"""LoRA adapters under tensor parallelism: each adapter cut like the base layer it adapts, and
the other ranks' slots kept the same as rank 0's.

A column-parallel projection (q/k/v, gate/up) gives each rank some output columns: its adapter
keeps A whole and takes those columns of B, so the rank's partial output is whole columns of
``x @ A.T @ B``. A row-parallel one (o, down) gives each rank some input channels: A takes those
channels and B stays whole, so each rank's ``x_part @ A_part.T @ B`` is a partial sum like its
base product; ``model.project`` adds it into that partial output before the layer's all-reduce,
which sums it once. The slicing is the base weights' own (``parallel/shard.shard_piece``), on
PEFT's layout (B ``[out, r]`` as a weight ``[out, in]``, A ``[r, in]``).

Rank 0 decides which adapter sits in which slot (``AdapterCache``); each load it makes travels
to the other ranks with the next step (``StepInputs.lora_loads``: slot, name, directory), and
each rank reads the directory and writes its own cut into that slot before the step's pass, the
first that may read it. A run-time load (``POST /v1/load_lora_adapter``) is only a name and a
directory until a request uses it, so it is cut on every rank the same way.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.services.engine.lora.peft_adapter import PeftAdapter, load_adapter
from pdserve.services.engine.model import LlamaForCausalLM
from pdserve.services.engine.parallel.shard import shard_piece

# PEFT projection -> (the fused parameter's name as ``shard_piece`` knows it, its piece index)
_COLUMN = {
    "q_proj": ("self_attn.qkv_proj.weight", 0),
    "k_proj": ("self_attn.qkv_proj.weight", 1),
    "v_proj": ("self_attn.qkv_proj.weight", 2),
    "gate_proj": ("mlp.gate_up_proj.weight", 0),
    "up_proj": ("mlp.gate_up_proj.weight", 1),
}
_ROW = {"o_proj": "self_attn.o_proj.weight", "down_proj": "mlp.down_proj.weight"}

# a slot load sent to the other ranks: (slot, adapter name, adapter directory)
SlotLoad = tuple[int, str, str]


def shard_adapter(adapter: PeftAdapter, model: LlamaForCausalLM) -> PeftAdapter:
    """``adapter`` cut for the rank ``model`` is (itself at TP 1)."""
    shard, cfg = model.shard, model.cfg
    if shard.size == 1:
        return adapter
    cut = PeftAdapter(name=adapter.name, config=adapter.config)
    for (layer, proj), (a, b) in adapter.weights.items():
        if proj in _COLUMN:  # B [r, out]: this rank's output columns
            suffix, index = _COLUMN[proj]
            name = f"model.layers.{layer}.{suffix}"
            b = shard_piece(name, index, b.T, cfg, shard).T.contiguous()
        else:  # A [r, in]: this rank's input channels
            name = f"model.layers.{layer}.{_ROW[proj]}"
            a = shard_piece(name, 0, a, cfg, shard).contiguous()
        cut.weights[layer, proj] = (a, b)
    return cut


def load_cut(name: str, path: Path, model: LlamaForCausalLM) -> PeftAdapter:
    """The adapter in ``path``, read and cut for this rank."""
    return shard_adapter(load_adapter(name, path, len(model.layers)), model)
