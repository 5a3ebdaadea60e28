"""``--lora-modules NAME=PATH`` parsed and checked, and an engine's ``AdapterCache`` built (rank
0), or a tensor-parallel rank's ``FollowerSlots``."""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.services.engine.lora.sharding import SlotLoad, load_cut
from pdserve.services.engine.lora.slots import AdapterCache, attach_stacks, write_slot
from pdserve.services.engine.model import LlamaForCausalLM
from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError

log = logging.getLogger(__name__)


def parse_modules(specs: list[str]) -> dict[str, Path]:
    """NAME=PATH pairs -> {name: directory}; a malformed or repeated one is a start-up error."""
    modules: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise StartupError(f"--lora-modules {spec!r}: expected NAME=PATH")
        if name in modules:
            raise StartupError(f"--lora-modules: {name!r} is named twice")
        if not Path(path).is_dir():
            raise StartupError(f"--lora-modules {name}: {path} is not a directory")
        modules[name] = Path(path)
    return modules


def serves_lora(config: EngineConfig) -> bool:
    """Whether an engine has adapter slots: the slots cost memory and a per-step slot list, so
    a worker that serves no adapter has none."""
    return bool(config.lora_modules) or config.enable_lora


def build_adapter_cache(config: EngineConfig, model: LlamaForCausalLM) -> AdapterCache | None:
    """Rank 0's adapter slots, None without ``--lora-modules`` or ``--enable-lora``."""
    modules = parse_modules(config.lora_modules)
    if not serves_lora(config):
        return None
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise StartupError("--max-loras and --max-lora-rank must be at least 1")
    return AdapterCache(model, modules, config.max_loras, config.max_lora_rank)


class FollowerSlots:
    """A tensor-parallel rank other than 0: the same slots as rank 0's, each load rank 0 made
    written into the same slot, cut for this rank (``sharding.py``)."""

    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int) -> None:
        self.model = model
        self.max_rank = max_rank
        attach_stacks(model, num_slots, max_rank)

    def apply(self, loads: list[SlotLoad]) -> None:
        for slot, name, path in loads:
            write_slot(self.model, slot, load_cut(name, Path(path), self.model), self.max_rank)
            log.info(
                "LoRA adapter %r loaded into slot %d (TP rank %d)",
                name,
                slot,
                self.model.shard.rank,
            )


def build_follower_slots(config: EngineConfig, model: LlamaForCausalLM) -> FollowerSlots | None:
    if not serves_lora(config):
        return None
    return FollowerSlots(model, config.max_loras + 1, config.max_lora_rank)
