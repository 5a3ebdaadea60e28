"""LoRA adapters loaded and unloaded at run time through ``pdserve up`` (issue 46): a prefill
and a decode worker started with ``--enable-lora`` and no adapter; ``POST
/v1/load_lora_adapter`` with the admin key (a user's key: 403) loads a PEFT adapter on both,
and generation under it through P/D is what HF + PEFT generates; an unload while a long
request runs under the adapter is accepted at once, new requests for the name get a 404, the
running one completes with the right tokens; once it has, the name can be loaded again."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from tests.integration.stack import free_port, pdserve_up
from tests.lora_support import build_adapter, peft_greedy

USER, ADMIN = "user-key", "admin-key"
PROMPT = list(range(5, 45))
LONG = 96  # tokens of the request that runs across the unload


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory):
    return build_adapter(llama_dir, tmp_path_factory.mktemp("lora-rt") / "a", seed=1, rank=8)


@pytest.fixture(scope="module")
def up(tmp_path_factory, llama_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("up-lora-rt") / "up.log"
    env = dict(PDSERVE_DTYPE="float64", PDSERVE_NUM_KV_BLOCKS="64", PDSERVE_DRAIN_SECONDS="5")
    args = ["--model", str(llama_dir), "--prefill-workers", "1", "--decode-workers", "1"]
    args += ["--port", str(port), "--enforce-eager", "--enable-lora"]
    args += ["--api-key", USER, "--admin-api-key", ADMIN]
    with pdserve_up(args, log, env):
        yield f"http://127.0.0.1:{port}"


def post(url: str, body: dict, key: str) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def test_load_generate_unload_while_running(up, llama_dir, adapter) -> None:
    from openai import AsyncOpenAI, NotFoundError

    from pdserve.gateway.tokenizer import ModelTokenizer

    tok = ModelTokenizer.from_dir(llama_dir)
    client = AsyncOpenAI(base_url=up + "/v1", api_key=USER)
    assert "a" not in [m.id for m in (await client.models.list()).data]
    load = {"lora_name": "a", "lora_path": str(adapter)}
    assert post(up + "/v1/load_lora_adapter", load, USER)[0] == 403
    status, answer = post(up + "/v1/load_lora_adapter", load, ADMIN)
    assert status == 200, answer
    assert {o["status"] for o in answer["workers"].values()} == {"ok"}
    assert len(answer["workers"]) == 2  # the prefill and the decode worker
    assert post(up + "/v1/load_lora_adapter", load, ADMIN)[0] == 400  # loaded already
    bad = {"lora_name": "b", "lora_path": str(adapter.parent / "missing")}
    status, answer = post(up + "/v1/load_lora_adapter", bad, ADMIN)
    assert status == 400 and "adapter_config.json" in answer["error"]["message"]

    expected = peft_greedy(llama_dir, adapter, [PROMPT], LONG)[0]
    short = await client.completions.create(
        model="a", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert short.choices[0].text == tok.decode(expected[:8])

    stream = await client.completions.create(
        model="a",
        prompt=PROMPT,
        max_tokens=LONG,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = aiter(stream)
    text = [(await anext(chunks)).choices[0].text]  # it runs on the decode worker
    status, answer = await asyncio.to_thread(
        post, up + "/v1/unload_lora_adapter", {"lora_name": "a"}, ADMIN
    )
    assert status == 200, answer
    assert "deferred" in {o["status"] for o in answer["workers"].values()}  # still in use
    with pytest.raises(NotFoundError):  # new requests: 404 at once
        await client.completions.create(model="a", prompt=PROMPT, max_tokens=2)
    assert "a" not in [m.id for m in (await client.models.list()).data]
    text += [c.choices[0].text async for c in chunks if c.choices]
    assert "".join(text) == tok.decode(expected)  # it kept its adapter to the end

    # the deferred unload completed on the workers: the name loads again
    status, answer = post(up + "/v1/load_lora_adapter", load, ADMIN)
    assert status == 200, answer
    await client.close()
