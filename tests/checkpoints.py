"""Tiny Hugging Face checkpoints built offline: random weights, save_pretrained, and a BPE
tokenizer trained on a few sentences. HF transformers running the same weights is the oracle."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated prefill and decode keep long prompts from stalling short ones.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "naïve café déjà vu — 日本語のテキスト 🚀 emoji",
    "def add(a, b):\n    return a + b\n",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# name -> (transformers config class name, kwargs)
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama-gqa": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        ),
    ),
    "llama-mha-tied": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-bias": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=512,
        ),
    ),
}


def train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build_checkpoint(name: str, out: Path, seed: int = 0) -> Path:
    import transformers

    cls_name, kwargs = VARIANTS[name]
    tok = train_tokenizer()
    config = getattr(transformers, cls_name)(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.1,
        **kwargs,
    )
    return save_checkpoint(config, tok, out, seed)


def save_checkpoint(config, tok, out: Path, seed: int = 0) -> Path:
    """Random weights for ``config`` (seeded), saved with ``tok`` and the chat template."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )
    return out


# A Qwen2.5-style chat template with hermes tool syntax (written for these tests): tools listed
# in the system turn, calls as <tool_call>{json}</tool_call>, results as <tool_response> turns.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}Functions you may call, inside <tools></tools>:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call one by answering <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% elif m['role'] == 'assistant' %}<|im_start|>assistant
{{ m['content'] or '' }}
{%- for c in m['tool_calls'] or [] %}
<tool_call>
{"name": "{{ c['function']['name'] }}", "arguments": {{ c['function']['arguments'] | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HERMES_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# as in Qwen2.5's tokenizer: one token each, but not special, so they stay in decoded text
HERMES_TAGS = ["<tool_call>", "</tool_call>"]


def build_hermes_checkpoint(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2 checkpoint whose tokenizer has hermes' tool tokens and whose chat template
    renders ``tools``: what ``--tool-call-parser auto`` reads as hermes."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        special_tokens=HERMES_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        [*CORPUS, '{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 2, trainer
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in HERMES_TAGS])
    _, kwargs = VARIANTS["qwen2-bias"]
    config = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=None,
        eos_token_id=2,
        initializer_range=0.1,
        **kwargs,
    )
    save_checkpoint(config, tok, out, seed)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": HERMES_TEMPLATE,
            }
        )
    )
    return out
