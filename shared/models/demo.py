"""The pdserve cache directory, and the demo model that lives in it.

Which model a ``--model`` value means (a built-in name, a .gguf file, a directory) is decided in
model_resolve.py.

The demo model is a small Llama with random weights and a byte-level tokenizer, generated
deterministically on first use. It exists so ``pdserve`` runs anywhere with no download; its text
is noise, and every process that loads it says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_NAME = "pdserve-demo-llama"
DEMO_VERSION = 1
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 264,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header|>",
    "<|end_header|>",
    "<|eot|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "<|start_header|>{{ m['role'] }}<|end_header|>\n{{ m['content'] }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>\n{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def ensure_demo_model() -> Path:
    target = cache_dir() / f"{DEMO_NAME}-v{DEMO_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so processes racing on first start never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write_demo_model(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("created demo model at %s", target)
    return target


def write_demo_model(out: Path, seed: int = 0, config: dict | None = None) -> None:
    """The demo model into ``out``; ``config`` (a Llama config.json's keys, default the demo's)
    writes a random Llama of another shape instead (perf/roofline_bench.py's realistic ones),
    its weights stored at its ``torch_dtype``, without an LM head when it ties its embeddings."""
    # torch is imported here, not at the top: the gateway finds the demo model's tokenizer through
    # this module and must stay torch-free.
    import torch
    from safetensors.torch import save_file

    cfg = DEMO_CONFIG if config is None else config
    dtype = getattr(torch, cfg.get("torch_dtype", "float32"))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    tensors = {"model.embed_tokens.weight": rand(v, h, std=1.0), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = rand(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.self_attn.q_proj.weight": rand(q_out, h),
            f"{p}.self_attn.k_proj.weight": rand(kv_out, h),
            f"{p}.self_attn.v_proj.weight": rand(kv_out, h),
            f"{p}.self_attn.o_proj.weight": rand(h, q_out),
            f"{p}.mlp.gate_proj.weight": rand(inter, h),
            f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter),
            f"{p}.input_layernorm.weight": torch.ones(h),
            f"{p}.post_attention_layernorm.weight": torch.ones(h),
        }
    save_file(
        {k: t.to(dtype).contiguous() for k, t in tensors.items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": [257, 260]}, indent=2)
    )
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": SPECIAL_TOKENS[0],
                "eos_token": SPECIAL_TOKENS[1],
                "model_max_length": cfg["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
                "pdserve_demo_model": True,
            },
            indent=2,
        )
    )
    (out / "README.md").write_text(
        "pdserve demo model: random weights and a byte-level tokenizer. Its output is noise.\n"
    )


def byte_level_tokenizer():
    """Ids 0-255 are the 256 bytes, then the special tokens; no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character map, which the ByteLevel pre-tokenizer uses.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
