"""The HF transformers oracle: what a checkpoint generates greedily, token by token."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import transformers

    # A plain greedy loop over HF's full forward: generate()'s min_new_tokens would mask EOS,
    # which the engine's ignore_eos deliberately does not do.
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out: list[int] = []
            for _ in range(max_tokens):
                logits = hf(input_ids=torch.tensor([p + out]), use_cache=False).logits
                out.append(int(logits[0, -1].argmax()))
            outs.append(out)
    return outs
