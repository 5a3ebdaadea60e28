"""``pdserve up`` end to end: its own nats-server, 2 prefill + 2 decode workers and the gateway as
real processes; real HTTP with the official openai client; HF transformers as the oracle; a dead
worker does not take it down; and SIGTERM leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.stack import (
    descendants,
    free_port,
    free_port_range,
    listening_sockets,
    pdserve_up,
    wait_until,
)
from tests.oracle import hf_greedy

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
LOCAL_THRESHOLD = 6  # prompts shorter than this are prefilled by the decode worker itself
PROMPTS = [
    list(range(5, 45)),
    [7, 300, 12, 99, 45, 45, 45, 2, 17, 18],
    list(range(100, 132)),
    [9, 9, 9],  # below the threshold: local prefill
]


def still_running(pid: int, start: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] == start and fields[0] != "Z"


@dataclass
class Up:
    proc: subprocess.Popen
    url: str
    log: Path
    metrics_base: int

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def up(tmp_path_factory, llama_dir):
    port = free_port()
    metrics_base = free_port_range(4)
    log = tmp_path_factory.mktemp("up") / "up.log"
    env = dict(
        OMP_NUM_THREADS="1",
        PDSERVE_DTYPE="float64",
        PDSERVE_NUM_KV_BLOCKS="64",
        PDSERVE_HEARTBEAT_SECONDS="0.2",
        PDSERVE_DRAIN_SECONDS="5",
    )
    args = ["--model", str(llama_dir), "--prefill-workers", "2", "--decode-workers", "2"]
    args += ["--port", str(port), "--local-prefill-threshold", str(LOCAL_THRESHOLD)]
    args += ["--metrics-port", str(metrics_base)]
    with pdserve_up(args, log, env) as proc:
        handle = Up(proc, f"http://127.0.0.1:{port}", log, metrics_base)
        # "ready" means every worker is registered, not just the one /health needs
        assert scrape(handle.url).count("pdserve_kv_cache_total_blocks{") == 4
        yield handle


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_ready_line(up) -> None:
    lines = [line for line in up.output().splitlines() if line.startswith("pdserve ready at")]
    assert len(lines) == 1 and lines[0].startswith(f"pdserve ready at {up.url}")


def test_everything_listens_on_loopback_only(up) -> None:
    """pdserve up's defaults: NATS, gateway, worker metrics and both KV-transfer ends (UCX's TCP
    transport, --ucx-host) listen on loopback, never on a wildcard or outward address."""
    sockets = {pid: listening_sockets(pid) for pid in [up.proc.pid, *descendants(up.proc.pid)]}
    listened = {addr for socks in sockets.values() for addr, _ in socks}
    assert listened and listened <= {"127.0.0.1", "::1"}, sockets
    assert sum(1 for socks in sockets.values() if socks) >= 6  # nats, gateway, 4 workers


async def test_streaming_matches_hf_via_openai_client(up, llama_dir) -> None:
    from openai import AsyncOpenAI

    from pdserve.gateway.tokenizer import ModelTokenizer

    expected = hf_greedy(llama_dir, PROMPTS, MAX_TOKENS)
    tok = ModelTokenizer.from_dir(llama_dir)
    client = AsyncOpenAI(base_url=up.url + "/v1", api_key="unused")
    model = (await client.models.list()).data[0].id

    async def stream(prompt: list[int]) -> tuple[str, str | None]:
        chunks = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, reason = "", None
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    results = await asyncio.gather(*(stream(p) for p in PROMPTS))
    for (text, reason), ids in zip(results, expected, strict=True):
        assert reason == "length"
        assert text == tok.decode(ids)
    await client.close()


def test_both_paths_were_used(up) -> None:
    """Disaggregated requests went through prefill workers and a UCX pull; short ones stayed
    local. Worker metrics ports are consecutive from --metrics-port."""
    scrapes = [scrape(f"http://127.0.0.1:{up.metrics_base + i}") for i in range(4)]
    prefill, decode = scrapes[:2], scrapes[2:]
    assert sum(metric(s, "pdserve_worker_prefill_time_seconds_count") for s in prefill) >= 3
    assert sum(metric(s, "pdserve_kv_transfer_bytes_total") for s in decode) > 0
    # and every block is back on every free list (the gateway re-exports worker loads)
    assert "pdserve_kv_cache_used_blocks{" in scrape(up.url)
    wait_until(
        lambda: metric(scrape(up.url), "pdserve_kv_cache_used_blocks{") == 0, 10, "blocks freed"
    )


def test_the_log_has_no_ucx_warnings(up) -> None:
    """Every worker has created its UCX context by now (KV was pulled both ways), and UCX warns
    about unused variables then: ucxx's UCX_MEMTYPE_CACHE default used to show up once per
    worker, which reads as a misconfiguration."""
    assert (
        sum(
            metric(
                scrape(f"http://127.0.0.1:{up.metrics_base + i}"), "pdserve_kv_transfer_bytes_total"
            )
            for i in (2, 3)
        )
        > 0
    )
    warnings = [line for line in up.output().splitlines() if "UCX  WARN" in line]
    assert not warnings, "\n".join(warnings)


async def open_stream(session, url: str, model: str, max_tokens: int, seed: int):
    body = {
        "model": model,
        "prompt": [5 + seed % 300, 6, 7, 8, 9, 10, 11],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    resp = await session.post(url + "/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return resp


async def next_event(resp) -> dict | None:
    """The next SSE data payload; None at [DONE] or end of stream."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return None
        if line.startswith("data: "):
            return json.loads(line[6:])
    return None


async def model_id(session, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def used_blocks_zero(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(url), "pdserve_kv_cache_used_blocks{") != 0:
        assert time.monotonic() < deadline, scrape(url)
        await asyncio.sleep(0.1)


def pids_of(up: Up, command: str) -> list[int]:
    out = []
    for pid in descendants(up.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pdserve.cli" in cmd and command.encode() in cmd:
            out.append(pid)
    return out


async def test_killed_prefill_worker_requests_are_retried(up) -> None:
    """A dead worker does not take ``pdserve up`` down, and requests routed to a prefill worker
    that just died are retried on the other one (prefill is idempotent) once it leaves the
    registry: they complete, late but without an error. (Killed decode workers, disconnects and
    32 concurrent streams are covered behind ``pdserve gateway`` in test_gateway_e2e.)"""
    import aiohttp

    victim = pids_of(up, "prefill")[0]
    os.kill(victim, signal.SIGKILL)
    async with aiohttp.ClientSession() as session:
        model = await model_id(session, up.url)

        async def complete(i: int) -> list[dict]:
            resp = await open_stream(session, up.url, model, 4, 200 + i)
            events = []
            while (event := await next_event(resp)) is not None:
                events.append(event)
            return events

        results = await asyncio.wait_for(asyncio.gather(*(complete(i) for i in range(6))), 30)
    for events in results:
        assert not any("error" in e for e in events), events
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    await used_blocks_zero(up.url, 10)
    assert up.proc.poll() is None


async def test_sigterm_finishes_streams_then_stops_everything(up) -> None:
    import aiohttp

    family = descendants(up.proc.pid)
    # nats-server, 1 surviving prefill worker, 2 decode workers, gateway
    assert len(family) >= 5, family
    async with aiohttp.ClientSession() as session:
        model = await model_id(session, up.url)
        resp = await open_stream(session, up.url, model, 300, 7)
        assert (await next_event(resp))["choices"]
        up.proc.send_signal(signal.SIGTERM)
        # the stream in flight still ends properly: gateway first, workers after it
        events = []
        while (event := await next_event(resp)) is not None:
            events.append(event)
    assert not any("error" in e for e in events), events[-3:]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert await asyncio.get_running_loop().run_in_executor(None, up.proc.wait, 30) == 0
    wait_until(
        lambda: not any(still_running(pid, start) for pid, start in family.items()),
        10,
        "all children gone",
    )


def test_gpu_placement_without_torch() -> None:
    from pdserve.services.control.launcher import gpu_for_worker, visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    # 2 prefill + 2 decode on 4 GPUs: one each; on 2 GPUs prefill and decode alternate
    assert [gpu_for_worker(i, ["0", "1", "2", "3"]) for i in range(4)] == ["0", "1", "2", "3"]
    assert [gpu_for_worker(i, ["0", "1"]) for i in range(3)] == ["0", "1", "0"]
    assert gpu_for_worker(0, ["0"]) is None  # one GPU (or none): the engine decides
