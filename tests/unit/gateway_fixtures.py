"""Small tokenizers for gateway tests, trained offline in well under a second (no downloads)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across workers.",
    "Grüße aus München! Ça va? naïve café déjà vu.",
    "日本語のテキストと中文文本。",
    "Emoji: 😀 🚀 🧪 👩‍💻 and symbols ∑ ∞ ≤ ≥.",
    "def add(a, b):\n    return a + b\n",
]

LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_byte_level(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def train_metaspace(vocab_size: int = 300) -> Tokenizer:
    """SentencePiece-like: spaces become '▁' and the decoder drops the leading one."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def write_model_dir(
    path: Path,
    tok: Tokenizer,
    *,
    template: str | None = LLAMA_LIKE_TEMPLATE,
    template_in_file: bool = False,
    max_position_embeddings: int = 256,
    extra_eos_id: int | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    eos_id = tok.token_to_id("</s>")
    tok_cfg: dict = {
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template is not None and template_in_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        tok_cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")
    gen_eos = [eos_id] if extra_eos_id is None else [eos_id, extra_eos_id]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    (path / "config.json").write_text(
        json.dumps(
            {
                "vocab_size": tok.get_vocab_size(),
                "max_position_embeddings": max_position_embeddings,
                "eos_token_id": eos_id,
                "bos_token_id": tok.token_to_id("<s>"),
            }
        )
    )
    return path


@contextlib.asynccontextmanager
async def serving(model_dir: Path, response_store=None, **options):
    """A gateway app over an in-memory bus with one fake decode worker "d0": (client, d0).
    ``options`` are GatewayConfig's; its worker timeout is long, since d0 beats once.
    ``response_store``: /v1/responses' store (default JetStream's, which the memory bus lacks)."""
    from aiohttp.test_utils import TestClient, TestServer

    from pdserve.gateway.server import create_app
    from pdserve.shared.config import BusConfig, EngineConfig, GatewayConfig
    from tests.bus_memory import MemoryBus, MemoryNetwork
    from tests.unit.fake_workers import NAMESPACE, FakeWorker, settle

    net = MemoryNetwork()
    bus_config = BusConfig(namespace=NAMESPACE)
    app = create_app(
        GatewayConfig(**{"worker_timeout": 60.0, **options}),
        EngineConfig(model=str(model_dir)),
        bus_config,
        message_bus=MemoryBus(bus_config, "gw", network=net),
        response_store=response_store,
    )
    async with TestClient(TestServer(app)) as client:
        d0 = await FakeWorker(net, "decode", "d0").start()
        await settle()
        try:
            yield client, d0
        finally:
            await d0.bus.close()
