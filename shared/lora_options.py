"""The engine's multi-LoRA options: the adapters served (PEFT directories, each its own model
name in ``/v1/models``), how many stay resident per worker, and the largest rank. A mixin of
``EngineConfig``, so that ``pdserve up`` hands the same list to the gateway and every worker."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.options import opt


@dataclass
class LoraOptions:
    lora_modules: list[str] = opt(
        [],
        "a LoRA adapter served as its own model: NAME=PATH of a PEFT directory; repeat",
        multiple=True,
    )
    enable_lora: bool = opt(
        False,
        "serve LoRA adapters loaded at run time (POST /v1/load_lora_adapter) even without "
        "--lora-modules (attaches the adapter slots)",
    )
    max_loras: int = opt(4, "LoRA adapters resident per worker (least recently used out)")
    max_lora_rank: int = opt(16, "the largest LoRA rank served (a larger adapter: start error)")
