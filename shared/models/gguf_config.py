"""GGUF metadata -> the Hugging Face ``config.json`` and ``generation_config.json`` fields that
pdserve reads (see model_config.ModelConfig and gateway/tokenizer.py).

llama.cpp names hyper-parameters ``<arch>.<key>``: ``llama.block_count``,
``llama.attention.head_count_kv``, ... Llama, SmolLM and Mistral files all say ``llama``; Qwen2
files say ``qwen2`` and carry q/k/v biases.
"""

from __future__ import annotations

import math
from typing import Any

from pdserve.shared.errors import ModelLoadError
from pdserve.shared.models.gguf_file import GGUFFile

# GGUF general.architecture -> HF model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}


def architecture(f: GGUFFile) -> str:
    arch = f.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(
            f"{f.path}: missing metadata 'general.architecture'; not a model file?"
        )
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{f.path}: architecture {arch!r} is not supported; pdserve serves "
            f"{', '.join(sorted(ARCHITECTURES))} (Llama, SmolLM, Mistral, Qwen2) GGUF files"
        )
    return arch


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """config.json for the model in ``f``."""
    arch = architecture(f)

    def need(key: str) -> int:
        value = f.integer(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{f.path}: missing metadata '{arch}.{key}'")
        if value <= 0:
            raise ModelLoadError(f"{f.path}: metadata '{arch}.{key}' is {value}")
        return value

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    kv_heads = f.integer(f"{arch}.attention.head_count_kv") or heads
    if hidden % heads or heads % kv_heads:
        raise ModelLoadError(
            f"{f.path}: {heads} attention heads do not divide hidden size {hidden} "
            f"or into {kv_heads} KV heads"
        )
    head_dim = f.integer(f"{arch}.attention.key_length") or hidden // heads
    rotary = f.integer(f"{arch}.rope.dimension_count") or head_dim
    if rotary != head_dim:
        # The engine rotates whole heads (as HF Llama does); partial rotary would be silently wrong.
        raise ModelLoadError(
            f"{f.path}: rope.dimension_count {rotary} != head size {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    vocab = f.integer(f"{arch}.vocab_size") or _vocab_from_tensors(f)
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": f.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": f.number(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(f, arch, head_dim),
        "max_position_embeddings": f.integer(f"{arch}.context_length") or 2048,
        # llama.cpp leaves output.weight out when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "torch_dtype": "float32",
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.integer(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[name] = value
    return cfg


def generation_config(f: GGUFFile) -> dict[str, Any]:
    """Stop ids: EOS plus llama.cpp's end-of-turn/-message ids (Llama 3's <|eot_id|>), which only
    the GGUF's ``eot``/``eom`` keys name."""
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = f.integer(f"tokenizer.ggml.{key}")
        if value is not None and value not in eos:
            eos.append(value)
    out: dict[str, Any] = {}
    bos = f.integer("tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = bos
    if eos:
        out["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    pad = f.integer("tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = pad
    return out


def _vocab_from_tensors(f: GGUFFile) -> int:
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{f.path}: missing tensor 'token_embd.weight'")
    return embed.shape[0]


def rope_scaling(f: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    kind = f.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none") and "rope_freqs.weight" not in f.tensors:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": f.number(f"{arch}.rope.scaling.factor", 1.0)}
    if kind not in (None, "none"):
        raise ModelLoadError(
            f"{f.path}: rope scaling {kind!r} is not supported (linear, llama3 are)"
        )
    return _llama3_from_freq_factors(f, arch, head_dim)


def _llama3_from_freq_factors(f: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    """Llama 3.1+ files store llama3 rope scaling only as per-frequency divisors
    (``rope_freqs.weight``). The engine implements llama3 scaling from its parameters, so find
    parameters that reproduce these divisors exactly; refuse rather than guess if none do."""
    import numpy as np

    from pdserve.shared.models.gguf_weights import dequantized

    divisors = dequantized(f.tensors["rope_freqs.weight"]).reshape(-1).astype(np.float64)
    if np.allclose(divisors, 1.0):
        return None
    base = f.number(f"{arch}.rope.freq_base", 10000.0)
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(divisors.max())
    candidates = [(8192.0, 1.0, 4.0)]  # Llama 3.1/3.2/3.3's values
    # Between the unchanged and the fully divided frequencies the blend weight is linear in
    # 1/wavelength: smooth = a/wavelen + b with a = original/(high-low), b = -low/(high-low).
    # Only a and b shape the divisors, so any (original, low, high) with the same a, b is exact;
    # fit them and take low = 1.
    blend = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    if blend.sum() >= 2 and factor > 1:
        smooth = (1 / divisors[blend] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv_freq[blend] / (2 * math.pi), smooth, 1)
        if b < 0:  # rounded: the file's float32 divisors carry a little noise
            candidates.insert(0, (round(float(-a / b), 2), 1.0, round(float(1 - 1 / b), 5)))
    for original, low, high in candidates:
        guess = _llama3_divisors(inv_freq, factor, low, high, original)
        if guess.shape == divisors.shape and np.allclose(guess, divisors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(original)
                if original.is_integer()
                else original,
            }
    raise ModelLoadError(
        f"{f.path}: tensor 'rope_freqs.weight' holds rope frequency factors that match no llama3 "
        "scaling; not supported"
    )


def _llama3_divisors(inv_freq, factor: float, low: float, high: float, original: int):
    import numpy as np

    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    # the llama3 rule: high frequencies unchanged, low ones divided by factor, a blend between
    return 1.0 / ((1.0 - smooth) / factor + smooth)
