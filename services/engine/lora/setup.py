"""``--lora-modules NAME=PATH`` parsed and checked, and an engine's ``AdapterCache`` built."""

from __future__ import annotations

from pathlib import Path

from pdserve.services.engine.lora.slots import AdapterCache
from pdserve.services.engine.model import LlamaForCausalLM
from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError


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


def build_adapter_cache(config: EngineConfig, model: LlamaForCausalLM) -> AdapterCache | None:
    """The engine's adapter slots, None without ``--lora-modules`` or ``--enable-lora``: the
    slots cost memory and a per-step slot list, so a worker that serves no adapter has none."""
    modules = parse_modules(config.lora_modules)
    if not modules and not config.enable_lora:
        return None
    if config.tensor_parallel_size > 1:
        raise StartupError("LoRA adapters are served at TP 1 only (adapters are not sharded yet)")
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise StartupError("--max-loras and --max-lora-rank must be at least 1")
    return AdapterCache(model, modules, config.max_loras, config.max_lora_rank)
