"""SmoothQuant-style smoothing for the W8A8 CPU path: per-input-channel scales that move
activation outliers into the weights before both are rounded to INT8.

A few input channels of a linear layer carry activations 10-100x the others (SmolLM2 has such
channels); per-token activation rounding then spends the INT8 range on them and rounds the rest
coarsely. With s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), the layer computes (x / s) @ (W * s).T,
the same product, with flatter activations and slightly less flat weights (Xiao et al., 2022).
max|X_j| comes from one plain forward pass of the float model over a calibration text written
for this repository (calibration_text.txt), not the quality text the results are measured on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from pdserve.services.engine.model import AttentionMetadata, ChunkGroup

CALIBRATION_TEXT = Path(__file__).parent / "calibration_text.txt"


def calibration_ids(model_dir: Path) -> list[int] | None:
    """The calibration text in the tokens of the model at ``model_dir`` (None: no tokenizer.json,
    e.g. a GGUF file, whose layers then stay unsmoothed)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).encode(CALIBRATION_TEXT.read_text()).ids


def smoothing_scales(act_max: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """s [K] for a weight [N, K] whose inputs reach act_max [K] per channel."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    s = act_max.float().clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def activation_maxima(model: nn.Module, token_ids: list[int], names: set[str]) -> dict[str, Tensor]:
    """max |input| per input channel of each nn.Linear in ``names`` over one pass of token_ids."""
    maxima: dict[str, Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if name in names and isinstance(module, nn.Linear):

            def hook(_m, args, name=name) -> None:
                x = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
                maxima[name] = x if name not in maxima else torch.maximum(maxima[name], x)

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        hidden = _plain_forward(model, token_ids)
    finally:
        for h in hooks:
            h.remove()
    if "lm_head" in names:  # its input, without the 49k-wide product (a third of the pass)
        maxima["lm_head"] = hidden.float().abs().amax(dim=0)
    return maxima


def _plain_forward(model: nn.Module, token_ids: list[int]) -> Tensor:
    """The model's own forward over one causal sequence, before the engine binds its cache and
    rope table (it does both after loading, over what is set here): a one-block stand-in cache
    that nothing is written to (every slot -1), attention over the packed K/V. The final normed
    hidden states [n, hidden]."""
    cfg = model.cfg
    device = model.embed_tokens.weight.device
    n = len(token_ids)
    model.init_rope(n, device)
    shape = (1, cfg.num_layers, 2, 1, model.num_local_kv_heads, cfg.head_dim)
    model.bind_kv_cache(torch.zeros(shape, dtype=model.embed_tokens.weight.dtype, device=device))
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
        decode_plan=None,
        verify=None,
        prefill=ChunkGroup(
            num_tokens=n,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=n,
            max_seqlen_k=n,
            block_tables=None,
        ),
    )
    positions = torch.arange(n, device=device)
    return model(torch.tensor(token_ids, device=device), positions, meta, positions)
