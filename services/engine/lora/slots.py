"""The resident adapters, stacked per fused projection so one step serves them all, and which
adapter sits in which slot.

Each of a layer's fused linears (qkv, o, gate_up, down) holds ``lora_a`` [S, parts * R, in] and
``lora_b`` [S, parts * R, out], S = ``--max-loras`` + 1 slots of rank R = ``--max-lora-rank``:
slot 0 is zeros (the base model). A fused projection's PEFT parts (q, k and v) take their own
rank rows and their own output columns, so B is block-diagonal and one product covers them.
Smaller ranks are padded with zero rows. Loading into a slot copies in place: the tensors the
compiled decode step was traced with stay the same tensors."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from pdserve.services.engine.lora.peft_adapter import PeftAdapter, read_config
from pdserve.services.engine.lora.sharding import SlotLoad, load_cut
from pdserve.services.engine.model import Linear, LlamaForCausalLM
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.errors import ModelLoadError

log = logging.getLogger(__name__)


def fused_parts(model: LlamaForCausalLM, layer: int) -> dict[str, tuple[Linear, int, int, int]]:
    """projection -> (its fused linear, its part index, first output column, output columns)."""
    block = model.decoder_layers()[layer]
    attn, mlp = block.self_attn, block.mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
    return {
        "q_proj": (attn.qkv_proj, 0, 0, q),
        "k_proj": (attn.qkv_proj, 1, q, kv),
        "v_proj": (attn.qkv_proj, 2, q + kv, kv),
        "o_proj": (attn.o_proj, 0, 0, attn.o_proj.out_features),
        "gate_proj": (mlp.gate_up_proj, 0, 0, inter),
        "up_proj": (mlp.gate_up_proj, 1, inter, inter),
        "down_proj": (mlp.down_proj, 0, 0, mlp.down_proj.out_features),
    }


_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


def attach_stacks(model: LlamaForCausalLM, num_slots: int, max_rank: int) -> None:
    """Give every fused projection its zeroed stacks (every slot the base model)."""
    weight = model.embed_tokens.weight
    for block in model.decoder_layers():
        mods = {
            "qkv_proj": block.self_attn.qkv_proj,
            "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj,
            "down_proj": block.mlp.down_proj,
        }
        for name, linear in mods.items():
            rows = _PARTS[name] * max_rank
            # buffers, not plain attributes: a compiled decode step would fold a plain tensor
            # attribute into its graph as a constant (the zeros of start-up)
            a = weight.new_zeros(num_slots, rows, linear.in_features)
            linear.register_buffer("lora_a", a, persistent=False)
            b = weight.new_zeros(num_slots, rows, linear.out_features)
            linear.register_buffer("lora_b", b, persistent=False)


def write_slot(model: LlamaForCausalLM, slot: int, adapter: PeftAdapter | None, max_rank: int):
    """Put ``adapter`` (None: nothing) into ``slot`` of every stack."""
    for block in model.decoder_layers():
        for linear in (block.self_attn.qkv_proj, block.self_attn.o_proj):
            _zero(linear, slot)
        for linear in (block.mlp.gate_up_proj, block.mlp.down_proj):
            _zero(linear, slot)
    if adapter is None:
        return
    check_fits(model, adapter)
    for (layer, proj), (a, b) in adapter.weights.items():
        linear, part, col, width = fused_parts(model, layer)[proj]
        r = a.shape[0]
        lo = part * max_rank
        stack_a, stack_b = _stacks(linear)
        stack_a[slot, lo : lo + r] = a.to(stack_a.dtype)
        stack_b[slot, lo : lo + r, col : col + width] = b.to(stack_b.dtype)


def check_fits(model: LlamaForCausalLM, adapter: PeftAdapter) -> None:
    """ModelLoadError unless every (A, B) pair has the shapes of the model's projection."""
    for (layer, proj), (a, b) in adapter.weights.items():
        linear, _, _, width = fused_parts(model, layer)[proj]
        if b.shape[1] != width or a.shape[1] != linear.in_features:
            raise ModelLoadError(
                f"LoRA adapter {adapter.name!r}: {proj} of layer {layer} is {tuple(a.shape)} x "
                f"{tuple(b.shape)}, the model's is {linear.in_features} -> {width}"
            )


def _stacks(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return linear.get_buffer("lora_a"), linear.get_buffer("lora_b")


def _zero(linear: nn.Module, slot: int) -> None:
    for stack in _stacks(linear):
        stack[slot].zero_()


class AdapterNameTaken(ModelLoadError):
    """A load of a name already served, or still being unloaded."""


class AdapterCache:
    """Which configured adapter sits in which slot. ``acquire`` pins an adapter for a sequence
    (loading it, lazily, into a free slot or the least recently used unpinned one) and
    ``release`` unpins it; an adapter that running sequences use is never evicted."""

    def __init__(
        self, model: LlamaForCausalLM, modules: dict[str, Path], max_loras: int, max_rank: int
    ) -> None:
        for name, path in modules.items():  # refuse at start-up, not at a request
            _check_rank(name, path, max_rank)
        self.model = model
        self.modules = dict(modules)
        self.max_rank = max_rank
        self.num_slots = max_loras + 1
        attach_stacks(model, self.num_slots, max_rank)
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident, least recently used first
        # the resident names as one tuple, replaced whole: what heartbeats read (another thread)
        self.resident_names: tuple[str, ...] = ()
        self.pins = [0] * self.num_slots
        self.loads = 0  # adapters read from disk (tests count lazy loads and evictions)
        # the names requests may name (``modules`` also holds those being unloaded while
        # requests still use them), one tuple replaced whole: other threads read it
        self.served: tuple[str, ...] = tuple(modules)
        self.users: dict[str, int] = {}  # requests in the engine per adapter
        # TP > 1: the slot loads made since the last step, for the other ranks (sharding.py)
        self.followed = model.shard.size > 1
        self.loads_due: list[SlotLoad] = []

    def add(self, name: str, path: Path) -> None:
        """Serve ``name`` from now on (``POST /v1/load_lora_adapter``): read and checked here
        (rank, projections, shapes), loaded into a slot lazily. ModelLoadError: why not."""
        if name in self.modules:
            why = "is being unloaded" if name not in self.served else "is already loaded"
            raise AdapterNameTaken(f"LoRA adapter {name!r} {why}")
        _check_rank(name, path, self.max_rank)
        check_fits(self.model, load_cut(name, path, self.model))
        self.modules[name] = path
        self.served = (*self.served, name)
        log.info("LoRA adapter %r added from %s", name, path)

    def remove(self, name: str) -> bool:
        """Stop serving ``name``: gone at once when no request uses it (True), else once the
        last one finishes (False); its running sequences keep their slot. KeyError: unknown."""
        if name not in self.served:
            raise KeyError(name)
        self.served = tuple(n for n in self.served if n != name)
        if self.users.get(name, 0):
            log.info("LoRA adapter %r unloads when its %d request(s) end", name, self.users[name])
            return False
        self._drop(name)
        return True

    def request_added(self, name: str) -> None:
        self.users[name] = self.users.get(name, 0) + 1

    def request_ended(self, name: str) -> None:
        left = self.users[name] = self.users.get(name, 1) - 1
        if left <= 0:
            del self.users[name]
            if name not in self.served and name in self.modules:  # a deferred unload
                self._drop(name)

    def _drop(self, name: str) -> None:
        del self.modules[name]
        slot = self.slot_of.pop(name, None)
        self.resident_names = tuple(self.slot_of)
        log.info("LoRA adapter %r unloaded%s", name, f" (slot {slot} free)" if slot else "")

    @property
    def resident(self) -> list[str]:
        return list(self.slot_of)

    def acquire(self, name: str) -> int | None:
        """``name``'s slot, pinned; None when every slot is pinned by other adapters."""
        if name not in self.modules:
            raise KeyError(name)
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            adapter = load_cut(name, self.modules[name], self.model)
            write_slot(self.model, slot, adapter, self.max_rank)
            if self.followed:
                self.loads_due.append((slot, name, str(self.modules[name])))
            self.slot_of[name] = slot
            self.resident_names = tuple(self.slot_of)
            self.loads += 1
            log.info("LoRA adapter %r loaded into slot %d", name, slot)
        self.slot_of.move_to_end(name)
        self.pins[slot] += 1
        return slot

    def take_loads(self) -> list[SlotLoad]:
        """The slot loads the other TP ranks have yet to make (sent with the next step)."""
        loads, self.loads_due = self.loads_due, []
        return loads

    def pin(self, seq: Sequence) -> bool:
        """Pin ``seq``'s adapter for it (admission; a preempted sequence keeps its pin). False
        when every slot is pinned by other adapters: it waits, as for blocks."""
        if seq.lora_name is None or seq.lora_slot:
            return True
        slot = self.acquire(seq.lora_name)
        seq.lora_slot = slot or 0
        return slot is not None

    def share(self, parent: Sequence, child: Sequence) -> None:
        """A forked choice that runs at once uses its parent's pinned slot too."""
        if parent.lora_slot:
            child.lora_slot = parent.lora_slot
            self.pins[parent.lora_slot] += 1

    def unpin(self, seq: Sequence) -> None:
        """``seq`` left the engine: its adapter may be evicted once no one else uses it."""
        if seq.lora_slot:
            self.pins[seq.lora_slot] -= 1
            seq.lora_slot = 0

    def _free_slot(self) -> int | None:
        used = set(self.slot_of.values())
        for slot in range(1, self.num_slots):
            if slot not in used:
                return slot
        for name, slot in self.slot_of.items():  # least recently used first
            if self.pins[slot] == 0:
                del self.slot_of[name]
                log.info("LoRA adapter %r evicted from slot %d", name, slot)
                return slot
        return None


def _check_rank(name: str, path: Path, max_rank: int) -> None:
    rank = read_config(name, path).rank
    if rank > max_rank:
        raise ModelLoadError(
            f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}"
        )
