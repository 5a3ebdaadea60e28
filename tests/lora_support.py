"""LoRA adapters made offline with PEFT on the tiny checkpoints, and HF + PEFT as the oracle.

PEFT starts B at zero (an adapter that changes nothing); these set every A and B to random
values, so an adapter applied wrongly - or not at all - changes the tokens."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    model_dir: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ALL_TARGETS,
    rslora: bool = False,
) -> Path:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    model.save_pretrained(out)
    return out


def peft_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """What HF (float64), with ``adapter`` applied by PEFT (None: the base), generates greedily."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).to(torch.float64)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out: list[int] = []
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([p + out]), use_cache=False).logits
                out.append(int(logits[0, -1].argmax()))
            outs.append(out)
    return outs
