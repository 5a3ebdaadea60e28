"""Small GGUF files for tests, written with ``gguf.GGUFWriter`` from tiny HF checkpoints.

``write_gguf`` lays a checkpoint out the way llama.cpp's converter does: its tensor names, Llama's
Q/K rows permuted for interleaved rotary, norms in F32, the byte-level BPE vocabulary and chat
template as metadata, and llama3 rope scaling as a ``rope_freqs`` tensor. Matrices are quantized
with ``gguf.quants.quantize``; for the K-quant types, which gguf-py can only dequantize, the blocks
are random bytes with small, finite scales (they test dequantization and loading, not accuracy).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

# llama.cpp's tensor names, HF suffix -> GGUF suffix
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# byte offsets of the float16 scale fields inside one block of each K-quant type
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# types gguf-py cannot quantize and whose blocks hold no float scale to tame (tests of refusal)
RANDOM_ONLY = {"Q2_K", "IQ4_NL"}


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".", 3)  # model, layers, N, rest
    return f"blk.{parts[2]}.{_NAMES[parts[3]]}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's (2, pairs) halves become (pairs, 2) interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    ckpt: Path,
    out: Path,
    qtype: str = "F32",
    *,
    pre: str = "gpt2",
    arch: str | None = None,
    drop: tuple[str, ...] = (),
    types: dict[str, str] | None = None,
    add_bos: bool = False,
    seed: int = 0,
) -> Path:
    """A GGUF of the HF checkpoint in ``ckpt``; matrices in ``qtype`` unless ``types`` names
    another type for a GGUF tensor name; GGUF tensors named in ``drop`` are left out."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    arch = arch or cfg["model_type"]
    weights = load_file(str(ckpt / "model.safetensors"))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(out.stem)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    # transformers 5 writes rope settings under rope_parameters, older versions at the top level
    rope = {**cfg, **(cfg.get("rope_parameters") or {})}
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, ckpt, pre, add_bos)

    if rope.get("rope_type") == "llama3" or (cfg.get("rope_scaling") or {}).get("rope_type"):
        w.add_tensor("rope_freqs.weight", _llama3_divisors(rope, head_dim))
    for name, value in weights.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        g = gguf_name(name)
        if g in drop:
            continue
        value = value.astype(np.float32)
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            value = permute_rows(value, heads if ".attn_q." in g else kv_heads)
        kind = (types or {}).get(g, qtype if value.ndim == 2 else "F32")
        _add(w, g, value, kind, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add(w, name: str, value: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    import gguf

    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, value)
    elif kind == "F16":
        w.add_tensor(name, value.astype(np.float16))
    elif kind in _K_SCALES or kind in RANDOM_ONLY:
        w.add_tensor(name, random_blocks(value.shape, kind, rng), raw_dtype=qt)
    else:
        w.add_tensor(name, gguf.quants.quantize(value, qt), raw_dtype=qt)


def random_blocks(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in ``kind``'s block layout, with small finite float16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rows, cols = shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _K_SCALES.get(kind, ()):
        scales = rng.uniform(1e-4, 5e-4, size=(rows, cols // block)).astype(np.float16)
        raw[..., off : off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _add_tokenizer(w, ckpt: Path, pre: str, add_bos: bool) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(tok_cfg["chat_template"])


def _llama3_divisors(rope: dict, head_dim: int) -> np.ndarray:
    s = rope.get("rope_scaling") or rope
    base = rope.get("rope_theta", 10000.0)
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def tiny_llama_256(out: Path, seed: int = 0) -> Path:
    """A one-layer Llama whose rows are 256 wide, so every type (K-quants too) fits its blocks."""
    import transformers

    from tests.checkpoints import save_checkpoint, train_tokenizer

    tok = train_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.05,
    )
    return save_checkpoint(config, tok, out, seed)
