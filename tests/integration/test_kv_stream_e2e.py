"""Layer-wise KV streaming end to end (issue 29 item 3): a gateway, a prefill worker that
streams prompts of 8 tokens and more, a decode worker that pulls them layer group by layer
group while they are prefilled, and one that only pulls in bulk. HF (float64) is the oracle.

A bus spy tells the paths apart: a streamed leg is a DecodeRequest that carries a streaming KV
handle and no first token (the pull brings it), a bulk leg carries the token and a complete
handle."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import nats
import pytest
from transformers import PreTrainedTokenizerFast

from pdserve.shared.bus.protocol import decode
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.telemetry import tracing
from tests.integration.stack import log_text
from tests.integration.test_gateway_e2e import WORKER_OPTIONS, serving
from tests.oracle import hf_greedy
from tests.otlp_receiver import OtlpReceiver

MAX_TOKENS = 6
OPTIONS = {
    **WORKER_OPTIONS,
    "local_prefill_threshold": 0,
    "kv_stream_threshold": 8,
    "max_num_batched_tokens": 16,  # a 40-token prompt takes 3 passes: streamed from the last
    "kv_failure_policy": "recompute",
}
PROMPT = (
    "Paged attention stores keys and values in fixed-size blocks, and a prefill worker "
    "computes them for a decode worker that pulls them over UCX."
)


class LegSpy:
    """The DecodeRequests on the bus, by client request id: (worker, streaming, output)."""

    def __init__(self) -> None:
        self.legs: dict[str, tuple[str, bool, list[int]]] = {}

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url)

        async def on_msg(msg) -> None:
            body = decode(msg.data)
            if isinstance(body, DecodeRequest):
                streaming = body.kv is not None and body.kv.streaming
                worker = msg.subject.rsplit(".", 1)[1]
                self.legs[body.client_id] = (worker, streaming, list(body.output_token_ids))

        await self.nc.subscribe("pdserve.decode.*", cb=on_msg)
        await self.nc.flush()


@pytest.fixture(scope="module")
def traces():
    receiver = OtlpReceiver()
    receiver.start_in_thread()
    yield receiver
    receiver.stop_in_thread()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir, traces, monkeypatch_module):
    for key, value in traces.env().items():
        monkeypatch_module.setenv(key, value)
    logs = tmp_path_factory.mktemp("kv-stream-logs")
    with serving(logs, llama_dir, ("p0",), ("d0",), OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


async def complete(base: str, rid: str, **body) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
    payload = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **body,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(
            base + "/v1/completions", json=payload, headers={"x-request-id": rid}
        ) as r:
            got = await r.json()
            assert r.status == 200, got
            return got


async def test_streamed_pulls_answer_what_hf_does(stack, llama_dir, traces) -> None:
    base, nats_url, _ = stack
    tok = PreTrainedTokenizerFast.from_pretrained(str(llama_dir))
    ids = tok.encode(PROMPT)
    assert len(ids) > 2 * OPTIONS["max_num_batched_tokens"]
    want = tok.decode(hf_greedy(llama_dir, [ids], MAX_TOKENS)[0], skip_special_tokens=True)
    spy = LegSpy()
    await spy.start(nats_url)
    try:
        got = await complete(base, "stream-1")
        assert got["choices"][0]["text"] == want
        worker, streaming, output = spy.legs["stream-1"]
        assert (worker, streaming, output) == ("d0", True, []), spy.legs
        # the first token alone: the request ends at the prefill worker, the leg is dropped
        one = await complete(base, "stream-2", max_tokens=1)
        assert one["choices"][0]["text"] == tok.decode(tok.encode(want)[:1]) or one["choices"][0]
        assert one["usage"]["completion_tokens"] == 1
        # two choices fork on the decode worker from the streamed prompt
        two = await complete(base, "stream-3", n=2)
        assert [c["text"] for c in two["choices"]] == [want, want]
    finally:
        await spy.nc.close()

    layers = json.loads((llama_dir / "config.json").read_text())["num_hidden_layers"]

    def streamed_span(spans) -> bool:
        return any(
            s.name == tracing.SPAN_KV_TRANSFER
            and s.attributes.get("pdserve.request_id") == "stream-1"
            and s.attributes.get("pdserve.kv.streamed") is True
            # the blocks of the earlier passes in one piece, then one per layer group
            # (--kv-stream-layer-groups' 4, or fewer layers) of the last pass's blocks
            and s.attributes.get("pdserve.kv.pieces") == 1 + min(4, layers)
            for s in spans
        )

    await traces.wait_for(streamed_span, 20)
    # every pull went through: the decode worker computed no prompt itself
    assert "recomputing the prefill" not in log_text(stack[2]["d0"], 10**6)


async def test_streamed_requests_run_together(stack, llama_dir) -> None:
    base, _, _ = stack
    tok = PreTrainedTokenizerFast.from_pretrained(str(llama_dir))
    prompts = [PROMPT, PROMPT[::-1], "short", PROMPT + " " + PROMPT]
    want = [
        tok.decode(o, skip_special_tokens=True)
        for o in hf_greedy(llama_dir, [tok.encode(p) for p in prompts], MAX_TOKENS)
    ]
    got = await asyncio.gather(
        *(complete(base, f"many-{i}", prompt=p) for i, p in enumerate(prompts))
    )
    assert [g["choices"][0]["text"] for g in got] == want
