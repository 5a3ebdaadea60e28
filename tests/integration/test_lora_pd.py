"""Multi-LoRA through P/D with ``pdserve up``: a prefill and a decode worker as real processes,
two PEFT adapters (``--lora-modules``, passed by ``up`` to every worker), the official openai
client. Requests under each adapter and under the base model, at once, generate exactly what
HF + PEFT does (the first token comes from the prefill worker, the rest from the decode worker
that pulled its KV: both must apply the adapter); ``/v1/models`` lists the adapters with their
parent; prefix-cache hits never cross adapters; an unknown name is a 404."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from tests.integration.stack import free_port, pdserve_up, wait_until
from tests.lora_support import build_adapter, peft_greedy

MAX_TOKENS = 8
PROMPTS = [list(range(5, 45)), [7, 300, 12, 99, 45, 45, 45, 2, 17, 18], list(range(100, 132))]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": build_adapter(llama_dir, root / "a", seed=1, rank=8),
        "b": build_adapter(llama_dir, root / "b", seed=2, rank=4, targets=("q_proj", "v_proj")),
    }


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def up(tmp_path_factory, llama_dir, adapters):
    port = free_port()
    log = tmp_path_factory.mktemp("up-lora") / "up.log"
    env = dict(
        OMP_NUM_THREADS="1",
        PDSERVE_DTYPE="float64",
        PDSERVE_NUM_KV_BLOCKS="64",
        PDSERVE_HEARTBEAT_SECONDS="0.2",
        PDSERVE_DRAIN_SECONDS="5",
    )
    args = ["--model", str(llama_dir), "--prefill-workers", "1", "--decode-workers", "1"]
    args += ["--port", str(port), "--enforce-eager"]
    for name, path in adapters.items():
        args += ["--lora-modules", f"{name}={path}"]
    with pdserve_up(args, log, env):
        url = f"http://127.0.0.1:{port}"

        def listed() -> bool:
            return len(get_json(url + "/v1/models")["data"]) == 3

        wait_until(listed, 20, "the adapters in /v1/models")
        yield url


def test_models_lists_adapters_with_parent(up) -> None:
    cards = get_json(up + "/v1/models")["data"]
    base = cards[0]["id"]
    assert [(c["id"], c.get("parent")) for c in cards] == [(base, None), ("a", base), ("b", base)]
    assert get_json(up + "/v1/models/a")["parent"] == base
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(up + "/v1/models/nope", timeout=5)
    assert err.value.code == 404


async def test_mixed_adapters_match_hf_peft_through_pd(up, llama_dir, adapters) -> None:
    from openai import AsyncOpenAI, NotFoundError

    from pdserve.gateway.tokenizer import ModelTokenizer

    tok = ModelTokenizer.from_dir(llama_dir)
    client = AsyncOpenAI(base_url=up + "/v1", api_key="unused")
    base = (await client.models.list()).data[0].id
    jobs = [(p, name) for p in PROMPTS for name in (None, "a", "b")]
    expected = [
        peft_greedy(llama_dir, adapters[name] if name else None, [p], MAX_TOKENS)[0]
        for p, name in jobs
    ]

    async def complete(prompt: list[int], name: str | None):
        return await client.completions.create(
            model=name or base,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )

    results = await asyncio.gather(*(complete(p, n) for p, n in jobs))
    for resp, ids in zip(results, expected, strict=True):
        assert resp.choices[0].text == tok.decode(ids)
    with pytest.raises(NotFoundError):
        await complete(PROMPTS[0], "nope")
    await client.close()


async def test_prefix_cache_hits_never_cross_adapters(up) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=up + "/v1", api_key="unused")
    prompt = list(range(200, 250))  # three full blocks of 16

    async def cached(name: str) -> int:
        resp = await client.completions.create(
            model=name, prompt=prompt, max_tokens=2, temperature=0.0
        )
        details = resp.usage.prompt_tokens_details if resp.usage else None
        return (details.cached_tokens or 0) if details else 0

    assert await cached("a") == 0
    assert await cached("b") == 0  # the same tokens under another adapter: nothing shared
    assert await cached("a") >= 32  # its own blocks
    await client.close()
